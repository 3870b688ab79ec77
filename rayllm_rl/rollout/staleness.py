"""Bounded-staleness admission control (AReaL), a plain thread-safe class without Ray.

With current policy version ``v`` (learner updates so far), batch size ``B`` (episodes per
learner step; one episode = one prompt's group of trajectories) and bound ``η``
(``max_staleness``), a new rollout may start only while

    accepted + running < (η + v + 1) · B

where ``running`` counts episodes started and not finished, and ``accepted`` counts
episodes finished and accepted into the buffer (cumulative since the start, less those
the buffer later discarded as over-stale, see :meth:`StalenessController.on_dropped`).
``η = 0`` is synchronous training: at most ``B`` episodes per version.

The admission rule alone does not bound staleness when episodes finish out of order (a
slow episode admitted at version ``w`` can finish after the learner moved past
``w + η``); the replay buffer therefore also drops over-stale episodes when the learner
samples (``rayllm_rl.rollout.replay_buffer``). Report those drops with ``on_dropped`` so
their slots are reused; otherwise every drop permanently shrinks the asynchronous slack
(after ``η·B`` drops training silently degrades to synchronous, and beyond that the
collector could no longer fill a batch).

Typical use by a collector::

    if ctl.try_admit():            # slot reserved, running += 1
        try:
            episode = await run_episode(...)
        except Exception:
            ctl.finish(accepted=False)        # failed: frees the slot
            raise
        if keep(episode) and buffer.put(episode):
            ctl.finish(accepted=True)
        ...                                   # (or retry the put later; it is still running)

and by the driver after each learner step: ``ctl.set_version(new_version)``.
"""
from __future__ import annotations

import operator
import threading
from typing import Any


def _check_count(name: str, n: Any) -> int:
    """An int >= 0 (anything with ``__index__``, e.g. numpy ints; not bool)."""
    if isinstance(n, bool):
        raise TypeError(f"{name} must be an int, got bool {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


class StalenessController:
    """Counts running/accepted episodes and admits new ones under the AReaL staleness bound.

    Args:
        batch_size: ``B``, episodes consumed per learner step (>= 1).
        max_staleness: ``η`` (>= 0); 0 is synchronous training.
        max_running: optional cap on concurrently running episodes (AReaL's
            ``max_concurrent_rollouts``); ``None`` = only the staleness bound applies.
        version: the starting policy version (e.g. when resuming), >= 0.

    All methods take an internal ``threading.Lock``; the counters are plain reads.
    """

    def __init__(self, batch_size: int, max_staleness: int, *, max_running: int | None = None,
                 version: int = 0) -> None:
        batch_size = _check_count("batch_size", batch_size)
        max_staleness = _check_count("max_staleness", max_staleness)
        version = _check_count("version", version)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_running is not None:
            max_running = _check_count("max_running", max_running)
            if max_running < 1:
                raise ValueError(f"max_running must be >= 1 or None, got {max_running}")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_running = max_running
        self._lock = threading.Lock()
        self._version = version
        self.running = 0    # admitted, not finished
        self.accepted = 0   # finished and accepted, less those later dropped as stale
        self.rejected = 0   # finished without being accepted (failed, filtered)
        self.dropped = 0    # accepted, then discarded by the buffer as over-stale
        self.admitted = 0   # cumulative admissions
        self.refused = 0    # try_admit calls answered False

    # ------------------------------------------------------------------ version

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self.set_version(v)

    def set_version(self, v: int) -> None:
        """Set the current policy version; it may only stay or grow (ValueError otherwise)."""
        v = _check_count("version", v)
        with self._lock:
            if v < self._version:
                raise ValueError(f"policy version must be monotonic: cannot go from {self._version} to {v}")
            self._version = v

    # ---------------------------------------------------------------- admission

    def limit(self) -> int:
        """``(η + v + 1) · B``: the most episodes that may be accepted-or-running now."""
        return (self.max_staleness + self._version + 1) * self.batch_size

    def _capacity_locked(self) -> int:
        cap = self.limit() - (self.accepted + self.running)
        if self.max_running is not None:
            cap = min(cap, self.max_running - self.running)
        return max(0, cap)

    def capacity(self) -> int:
        """How many more episodes may start now (>= 0)."""
        with self._lock:
            return self._capacity_locked()

    def try_admit(self, n: int = 1) -> bool:
        """Reserve ``n`` episode slots, all or nothing; on success ``running += n``."""
        n = _check_count("n", n)
        with self._lock:
            if n > self._capacity_locked():
                self.refused += 1
                return False
            self.running += n
            self.admitted += n
            return True

    def finish(self, n: int = 1, accepted: bool = True) -> None:
        """``n`` running episodes ended. Accepted ones count towards the bound; rejected ones
        (failed episode, group dropped by a filter) just free their slot."""
        n = _check_count("n", n)
        with self._lock:
            if n > self.running:
                raise ValueError(f"finish({n}) but only {self.running} episodes are running")
            self.running -= n
            if accepted:
                self.accepted += n
            else:
                self.rejected += n

    def on_dropped(self, n: int = 1) -> None:
        """``n`` accepted episodes were discarded before training (over-stale at sampling):
        they leave ``accepted`` (counted in ``dropped``), freeing their slots."""
        n = _check_count("n", n)
        with self._lock:
            if n > self.accepted:
                raise ValueError(f"on_dropped({n}) but only {self.accepted} episodes are accepted")
            self.accepted -= n
            self.dropped += n

    # ---------------------------------------------------------------- reporting

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "version": self._version,
                "batch_size": self.batch_size,
                "max_staleness": self.max_staleness,
                "running": self.running,
                "accepted": self.accepted,
                "accepted_total": self.accepted + self.dropped,
                "rejected": self.rejected,
                "dropped": self.dropped,
                "admitted": self.admitted,
                "refused": self.refused,
                "limit": self.limit(),
                "capacity": self._capacity_locked(),
            }

    def state_dict(self) -> dict[str, int]:
        """Counters to checkpoint. Running episodes are not saved: they die with the process."""
        with self._lock:
            return {"version": self._version, "accepted": self.accepted, "rejected": self.rejected,
                    "dropped": self.dropped, "admitted": self.admitted - self.running, "refused": self.refused}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters (running becomes 0; episodes in flight at save time are gone)."""
        vals = {k: _check_count(k, int(state[k])) for k in ("version", "accepted", "rejected", "dropped")}
        with self._lock:
            self._version = vals["version"]
            self.accepted, self.rejected, self.dropped = vals["accepted"], vals["rejected"], vals["dropped"]
            self.admitted = int(state.get("admitted", self.accepted + self.rejected + self.dropped))
            self.refused = int(state.get("refused", 0))
            self.running = 0

    def __repr__(self) -> str:
        return (f"StalenessController(B={self.batch_size}, eta={self.max_staleness}, v={self._version}, "
                f"running={self.running}, accepted={self.accepted}, capacity={self.capacity()})")
