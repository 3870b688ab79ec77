"""The driver's watch over a running job's actors: which roles died, and a replica Ray restarted gets the
version last synced (it serves nothing until then). `RayBackend` holds one per cluster it builds."""
from __future__ import annotations

import concurrent.futures
import time

import ray

from rayllm_rl.orchestration.backend import RoleCrashed
from rayllm_rl.orchestration.fault_ledger import FaultLedger
from rayllm_rl.job.plan import JobPlan
from rayllm_rl.orchestration.ray.cluster import Cluster, rejoin_sync_group, restarted_replicas


class Liveness:
    """Dead roles and restarted replicas of one cluster, checked every `every_s` while the driver waits."""

    def __init__(self, cluster: Cluster, plan: JobPlan, faults: FaultLedger, every_s: float = 10.0):
        """`faults`: counts the replicas Ray restarted."""
        self.cluster, self.plan, self.faults = cluster, plan, faults
        self.every_s = every_s
        """While waiting for a batch, a drain or an eval, check every this many seconds that no role died
        (and send the current weights to a replica Ray restarted)."""
        self.synced: int | None = None
        """The version the replicas were last sent: a replica Ray restarts since gets it again."""

    def dead_roles(self) -> list[str]:
        return self.cluster.dead_roles()

    def rejoin_restarted(self, version: int | None) -> dict[str, float] | None:
        """If Ray restarted replicas since the group formed, form the group again with the new
        processes and send them `version` (they refuse requests until then); None if none were,
        or if no version was synced yet (the first sync forms the group with them)."""
        if version is None:
            return None
        restarted = restarted_replicas(self.cluster)
        if not restarted:
            return None
        self.faults.replicas_restarted(len(restarted))
        rejoin_sync_group(self.cluster, self.plan, restarted)
        return self.cluster.sync_weights(version)

    def await_live(self, job, what: str, bounded: bool = True):
        """Wait for `job` (an ObjectRef, or a Future of work on the driver), at most the job's timeout
        + 30 s if `bounded`, while it may need the replicas: every `every_s`, a dead role ends the
        wait (RoleCrashed) and a replica Ray restarted (its process died, or its node was lost) gets
        the version last synced, without which it serves nothing (with no other replica, what is
        waited for would never finish)."""
        c, local = self.cluster, isinstance(job, concurrent.futures.Future)
        deadline = time.monotonic() + c.timeout_s + 30
        while not (concurrent.futures.wait([job], timeout=self.every_s).done if local
                   else ray.wait([job], timeout=self.every_s)[0]):
            dead = self.dead_roles()
            if dead:
                raise RoleCrashed(dead, RuntimeError(f"waiting for the {what}"))
            self.rejoin_restarted(self.synced)
            if bounded and time.monotonic() > deadline:
                raise TimeoutError(f"no {what} in {c.timeout_s + 30:g}s")
        return job.result() if local else c.get(job, None)
