"""What every weight transport shares: its errors (a failed or timed-out phase) and `Closing`.

Kept apart from any transport so the learner, the launchers and the tests can name a weight-sync failure
without importing a transport (nor torch.distributed, nor Ray). No port is picked here: a group's rank 0
binds its store and publishes the port it got (`rayllm_rl.rendezvous`).
"""
from __future__ import annotations

__all__ = ["WeightSyncError", "WeightSyncTimeout", "is_timeout_error", "sync_error", "Closing"]


class WeightSyncError(RuntimeError):
    """A weight synchronisation failed (peer gone, plan mismatch, bad tensors, ...)."""

    def __init__(self, message: str, *, phase: str | None = None, rank: int | None = None,
                 world_size: int | None = None, timeout_s: float | None = None):
        super().__init__(message)
        self.phase = phase
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A phase of a weight synchronisation did not complete within its timeout."""


_TIMEOUT_MARKERS = ("timed out", "timeout", "time out", "deadline")


def is_timeout_error(exc: BaseException) -> bool:
    """Whether a c10d / gloo exception reports an expired deadline (vs. e.g. a closed socket)."""
    if isinstance(exc, WeightSyncError):  # our own messages always mention "timeout"
        return isinstance(exc, WeightSyncTimeout)
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return any(m in text for m in _TIMEOUT_MARKERS)


def sync_error(exc: BaseException | None, *, phase: str, rank: int, world_size: int, timeout_s: float,
               where: str = "", detail: str = "") -> WeightSyncError:
    """Build the WeightSyncError / WeightSyncTimeout for a failed `phase` (cause: `exc`)."""
    timed_out = exc is None or is_timeout_error(exc)
    cls = WeightSyncTimeout if timed_out else WeightSyncError
    what = "timed out" if timed_out else "failed"
    cause = f": {type(exc).__name__}: {str(exc).strip()[:500]}" if exc is not None else ""
    msg = (f"weight sync phase '{phase}' {what} on rank {rank} of world size {world_size} "
           f"(timeout {timeout_s:g}s{', ' + where if where else ''}){'; ' + detail if detail else ''}{cause}")
    return cls(msg, phase=phase, rank=rank, world_size=world_size, timeout_s=timeout_s)


class Closing:
    """`with obj:` calls `obj.close()` on exit (groups and senders own sockets or segments)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
