"""FaultLedger: one job's fault accounting -- role restarts, episodes re-run and lost, and the checkpoint
baseline a rollback returns to. A plain class without Ray, owned by the backend.

Facts come in from two places: the backend itself (a replica Ray restarted and the driver re-joined,
roles a rollback rebuilt) and the collector, which reports what it saw while running episodes as
*fault events* (`record`):

    (RERUN, group_id)       an episode's env worker died; the episode runs again under the same id
    (LOST, group_id)        an episode's env worker died on every attempt; the episode is given up
    (ENV_PID, worker, pid)  env worker `worker` answered from process `pid` (a new pid: Ray restarted it)

The summary's meaning (docs/ray-orchestration.md, "Crashes"): `episodes_rerun` counts episodes run
again, after their worker died or because a rollback redoes the steps after the checkpoint;
`episodes_lost` counts episodes given up and never redone; `restarts` counts restarts per role kind.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

RERUN, LOST, ENV_PID = "rerun", "lost", "env_pid"
"""The kinds of fault event a collector reports (first item of each event tuple)."""


def role_kind(role: str) -> str:
    """`"env-3"` -> `"env"`, `"inference-0"` -> `"inference"`; a role without an index is its own kind."""
    return role.rsplit("-", 1)[0] if role[-1].isdigit() and "-" in role else role


class FaultLedger:
    """Restarts, re-runs, losses and the checkpoint baseline of one job, in one place.

    `role_kinds` are the roles the summary's `restarts` lists (each starts at 0); a crash naming
    another kind adds it.
    """

    def __init__(self, role_kinds: Sequence[str]):
        self.restarts: dict[str, int] = dict.fromkeys(role_kinds, 0)
        """Restarts per role kind, not counting env workers' restarts seen through `ENV_PID` events
        of the current env workers (`env_worker_restarts`)."""
        self.episodes_rerun = 0
        self.episodes_lost = 0
        self.lost_at_checkpoint = 0
        """`episodes_lost` when the last checkpoint was taken: a rollback returns to it."""
        self._env_pids: dict[int, set[int]] = {}
        """Per env worker of the current set: every process id it answered from."""

    # ------------------------------------------------------------------ facts
    def record(self, events: Iterable[Sequence[Any]]) -> None:
        """Fold in the collector's fault events (see the module docstring); an unknown kind is an error."""
        for event in events:
            kind = event[0]
            if kind == RERUN:
                self.episodes_rerun += 1
            elif kind == LOST:
                self.episodes_lost += 1
            elif kind == ENV_PID:
                _, worker, pid = event
                self._env_pids.setdefault(int(worker), set()).add(int(pid))
            else:
                raise ValueError(f"unknown fault event {event!r}: expected kind {RERUN!r}, {LOST!r} or {ENV_PID!r}")

    def replicas_restarted(self, n: int) -> None:
        """`n` inference replicas came back in new processes and re-joined the weight sync."""
        if n < 0:
            raise ValueError(f"replicas_restarted(n) needs n >= 0, got {n}")
        self.restarts["inference"] = self.restarts.get("inference", 0) + n

    def env_worker_restarts(self) -> list[int]:
        """Restarts seen per current env worker (its process ids less one), in worker order."""
        if not self._env_pids:
            return []
        return [max(len(self._env_pids.get(i, ())) - 1, 0) for i in range(max(self._env_pids) + 1)]

    # ------------------------------------------------------------------ checkpoints and rollbacks
    def checkpoint_taken(self) -> None:
        """A complete checkpoint was saved: a later rollback returns here."""
        self.lost_at_checkpoint = self.episodes_lost

    def rolled_back(self, crashed_roles: Iterable[str]) -> None:
        """Every role is rebuilt and the last checkpoint restored. The crashed roles count a restart each;
        the env workers' restarts seen so far are kept (the new workers start a fresh count); episodes
        lost since the checkpoint are run again by the redone steps, so they become re-runs."""
        for role in crashed_roles:
            kind = role_kind(role)
            self.restarts[kind] = self.restarts.get(kind, 0) + 1
        self.restarts["env"] = self.restarts.get("env", 0) + sum(self.env_worker_restarts())
        self._env_pids = {}
        self.episodes_rerun += self.episodes_lost - self.lost_at_checkpoint
        self.episodes_lost = self.lost_at_checkpoint

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, Any]:
        """The summary's fault keys: `episodes_rerun`, `episodes_lost`, `restarts` (per role kind)."""
        restarts = {**self.restarts, "env": self.restarts.get("env", 0) + sum(self.env_worker_restarts())}
        return {"episodes_rerun": self.episodes_rerun, "episodes_lost": self.episodes_lost, "restarts": restarts}
