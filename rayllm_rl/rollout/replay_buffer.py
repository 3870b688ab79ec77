"""Bounded, version-aware FIFO replay buffer of whole episodes (plain class, no Ray).

An episode is one prompt's group of trajectories: a trajectory TensorDict
(``rayllm_rl.data.trajectory``) with batch ``[n, T]``. The buffer never silently loses
data: ``put`` answers False when full (the caller keeps the episode and retries later),
and the only discards are over-stale episodes at sampling time (AReaL's ``v − η`` rule),
which are counted in ``dropped_stale`` / ``dropped_stale_tokens``.

Staleness of an episode at version ``v`` is ``v − min(version of its generated tokens)``;
generated tokens are those with ``loss_mask`` set and a version >= 0 (prompt, tool and
padding tokens carry version -1). An episode without generated tokens has staleness 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import operator
import threading
from collections import deque
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rayllm_rl.data.trajectory import concat_padded, validate_trajectory

_COUNTERS = ("puts", "rejected_full", "sampled", "sampled_sequences", "dropped_stale",
             "dropped_stale_sequences", "dropped_stale_tokens")


def _as_int(name: str, x: Any, minimum: int) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got bool {x!r}")
    try:
        x = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}") from None
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def _generated_mask(td: TensorDictBase) -> torch.Tensor:
    """Tokens the policy generated: loss_mask set and a real (>= 0) version."""
    return td["loss_mask"].bool() & (td["versions"] >= 0)


def min_generated_version(td: TensorDictBase) -> int | None:
    """Oldest policy version among the generated tokens, or None when there are none."""
    mask = _generated_mask(td)
    if not bool(mask.any()):
        return None
    return int(td["versions"][mask].min())


def episode_staleness(td: TensorDictBase, current_version: int) -> int:
    """``current_version − min(versions of generated tokens)``; 0 with no generated tokens."""
    oldest = min_generated_version(td)
    return 0 if oldest is None else int(current_version) - oldest


def batch_staleness_stats(td: TensorDictBase, current_version: int) -> dict[str, float | int]:
    """Per-token version lag ``v − versions`` over the generated tokens of a batch.

    Returns ``mean_lag`` (float), ``max_lag`` (int) and ``tokens`` (how many tokens were
    measured); both lags are 0 when the batch has no generated token.
    """
    mask = _generated_mask(td)
    lag = int(current_version) - td["versions"][mask]
    n = int(lag.numel())
    if n == 0:
        return {"mean_lag": 0.0, "max_lag": 0, "tokens": 0}
    return {"mean_lag": float(lag.double().mean()), "max_lag": int(lag.max()), "tokens": n}


class ReplayBuffer:
    """FIFO of whole episodes with a capacity (in episodes) and a staleness bound.

    Args:
        capacity_episodes: the most episodes stored at once (>= 1).
        max_staleness: ``η``; at sampling, episodes with staleness ``> η`` are dropped.
            ``None`` disables the drop (e.g. off-policy data that carries no versions).

    Thread-safe (one internal lock), so a threaded or async actor may share it.
    """

    def __init__(self, capacity_episodes: int, max_staleness: int | None) -> None:
        self.capacity_episodes = _as_int("capacity_episodes", capacity_episodes, 1)
        self.max_staleness = None if max_staleness is None else _as_int("max_staleness", max_staleness, 0)
        self._lock = threading.Lock()
        # (episode, oldest generated version or None, number of generated tokens)
        self._episodes: deque[tuple[TensorDictBase, int | None, int]] = deque()
        self._counters = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ writing

    def put(self, episode: TensorDictBase) -> bool:
        """Append one episode; False (and nothing stored) when the buffer is full.

        Raises ValueError for something that is not a valid, non-empty trajectory batch.
        """
        if not isinstance(episode, TensorDictBase):
            raise TypeError(f"put expects a trajectory TensorDict, got {type(episode).__name__}")
        validate_trajectory(episode)
        if episode.batch_size[0] == 0:
            raise ValueError("put: empty episode (batch size 0)")
        with self._lock:
            if len(self._episodes) >= self.capacity_episodes:
                self._counters["rejected_full"] += 1
                return False
            mask = _generated_mask(episode)
            oldest = int(episode["versions"][mask].min()) if bool(mask.any()) else None
            self._episodes.append((episode, oldest, int(mask.sum())))
            self._counters["puts"] += 1
            return True

    # ------------------------------------------------------------------ reading

    def _is_stale(self, oldest: int | None, current_version: int) -> bool:
        return self.max_staleness is not None and oldest is not None and current_version - oldest > self.max_staleness

    def _drop_stale_locked(self, current_version: int) -> int:
        keep: deque = deque()
        dropped = 0
        for entry in self._episodes:
            td, oldest, n_tokens = entry
            if self._is_stale(oldest, current_version):
                dropped += 1
                self._counters["dropped_stale_sequences"] += int(td.batch_size[0])
                self._counters["dropped_stale_tokens"] += n_tokens
            else:
                keep.append(entry)
        self._episodes = keep
        self._counters["dropped_stale"] += dropped
        return dropped

    def drop_stale(self, current_version: int) -> int:
        """Drop every stored episode whose staleness exceeds ``max_staleness``; returns how many."""
        current_version = _as_int("current_version", current_version, 0)
        with self._lock:
            return self._drop_stale_locked(current_version)

    def sample(self, n_episodes: int, current_version: int) -> TensorDict | None:
        """Drop over-stale episodes, then pop the oldest ``n_episodes`` concatenated (padded).

        Returns None, keeping what is stored, when fewer than ``n_episodes`` remain. The
        number of episodes dropped by this call is ``stats()["dropped_stale"]`` difference
        (or call :meth:`drop_stale` first to get it directly).
        """
        n_episodes = _as_int("n_episodes", n_episodes, 1)
        current_version = _as_int("current_version", current_version, 0)
        with self._lock:
            self._drop_stale_locked(current_version)
            if len(self._episodes) < n_episodes:
                return None
            taken = [self._episodes.popleft()[0] for _ in range(n_episodes)]
            self._counters["sampled"] += n_episodes
            self._counters["sampled_sequences"] += sum(int(td.batch_size[0]) for td in taken)
        return concat_padded(taken)

    def __len__(self) -> int:
        return len(self._episodes)

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            return {
                "size": len(self._episodes),
                "sequences": sum(int(td.batch_size[0]) for td, _, _ in self._episodes),
                "capacity": self.capacity_episodes,
                "max_staleness": self.max_staleness,
                **self._counters,
            }

    # --------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Stored episodes (as plain dicts of tensors, loadable with ``torch.load(weights_only=True)``)
        and counters. The tensors are shared with the buffer, not copied."""
        with self._lock:
            return {
                "capacity_episodes": self.capacity_episodes,
                "max_staleness": self.max_staleness,
                "episodes": [td.to_dict() for td, _, _ in self._episodes],
                "counters": dict(self._counters),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a ``state_dict``; capacity and bound stay this buffer's own."""
        episodes = []
        for i, ep in enumerate(state["episodes"]):
            td = ep if isinstance(ep, TensorDictBase) else TensorDict(ep, batch_size=[ep["input_ids"].shape[0]])
            try:
                validate_trajectory(td)
            except ValueError as exc:
                raise ValueError(f"load_state_dict: episode {i}: {exc}") from None
            episodes.append((td, min_generated_version(td), int(_generated_mask(td).sum())))
        if len(episodes) > self.capacity_episodes:
            raise ValueError(f"load_state_dict: {len(episodes)} episodes do not fit capacity {self.capacity_episodes}")
        counters = dict.fromkeys(_COUNTERS, 0)
        counters.update({k: int(v) for k, v in state.get("counters", {}).items() if k in counters})
        with self._lock:
            self._episodes = deque(episodes)
            self._counters = counters

    def __repr__(self) -> str:
        return (f"ReplayBuffer(size={len(self)}/{self.capacity_episodes}, max_staleness={self.max_staleness}, "
                f"dropped_stale={self._counters['dropped_stale']})")


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """The job's replay buffer, the same in both backends (`JobPlan.buffer_spec`)."""

    capacity: int
    """Episodes held at most (`rollout.buffer_episodes`, or 2 x (max_staleness + 1) x prompts_per_step)."""
    max_staleness: int | None

    def build(self, on_dropped=None) -> "AwaitableEpisodeBuffer":
        """The awaitable buffer; `on_dropped(n)`: told of episodes dropped as over-stale (the collector's slots)."""
        return AwaitableEpisodeBuffer(ReplayBuffer(self.capacity, self.max_staleness), on_dropped=on_dropped)


class AwaitableEpisodeBuffer:
    """A :class:`ReplayBuffer` with awaitable `put` and `get_batch`: no polling on either side.

    Writers (env workers) wait for room instead of retrying; the learner's `get_batch(n, v)`
    wakes when enough episodes within the staleness bound are stored. Episodes dropped as
    over-stale are reported to `on_dropped(n)` (the collector gives their slots back).
    Single event loop: call it from one asyncio loop (e.g. inside an async Ray actor).
    """

    def __init__(self, buffer: ReplayBuffer, on_dropped=None):
        self.buffer = buffer
        self.on_dropped = on_dropped
        self._changed = asyncio.Condition()
        self._failure: str | None = None
        self._wake_task: asyncio.Task | None = None

    def fail(self, reason: str) -> None:
        """The producer side died: waiting and later `get_batch` calls raise with `reason` (at once
        when called on the buffer's loop, else within a second)."""
        self._failure = reason
        try:  # keep a reference: the loop holds tasks only weakly
            self._wake_task = asyncio.get_running_loop().create_task(self._notify())
        except RuntimeError:  # no loop in this thread: the waiters re-check the flag every second
            pass

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, deadline: float, what: str) -> None:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise TimeoutError(f"replay buffer: {what}")
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:  # re-check the failure flag at least every second
                pass

    async def put(self, episode: TensorDictBase, timeout_s: float) -> None:
        """Store `episode`, waiting (at most `timeout_s`) while the buffer is full; never drops it."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.buffer.put(episode):
            await self._wait(deadline, f"still full ({self.buffer.capacity_episodes} episodes) after {timeout_s:g}s")
        await self._notify()

    async def get_batch(self, n_episodes: int, current_version: int, timeout_s: float) -> tuple[TensorDict, int]:
        """The oldest `n_episodes` within the staleness bound at `current_version`, concatenated,
        and the number of episodes left; waits for them at most `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._failure is not None:
                raise RuntimeError(f"replay buffer: no more episodes will come: {self._failure}")
            dropped = self.buffer.drop_stale(current_version)
            if dropped and self.on_dropped is not None:
                self.on_dropped(dropped)
            batch = self.buffer.sample(n_episodes, current_version)
            if batch is not None:
                await self._notify()  # room for waiting writers
                return batch, len(self.buffer)
            await self._wait(deadline, f"fewer than {n_episodes} episodes within the staleness bound at version "
                                       f"{current_version} after {timeout_s:g}s (have {len(self.buffer)})")
