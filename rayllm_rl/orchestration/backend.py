"""What the driver needs of a job's roles, whichever backend runs them.

`RayBackend` (ray/backend.py) reaches actors; `LocalBackend` (local/backend.py) reaches the
same plain classes in this process. The driver (driver.py) is one loop over either: same
SFT warm start, resume, periodic checkpoints, weight syncs and summary. The driver owns the
policy version and passes it in; no backend keeps a version counter of its own.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol


ROLE_KINDS = ("env", "inference", "learner", "collector", "replay-buffer", "reference")
"""The roles the summary's `restarts` counts."""


class RoleCrashed(RuntimeError):
    """A role's process died; the driver rolls the job back to its last checkpoint (`Backend.recover`)."""

    def __init__(self, roles: list[str], cause: BaseException):
        super().__init__(f"role(s) {', '.join(roles)} died: {type(cause).__name__}: {cause}")
        self.roles = roles


VERSIONS_SHOWN = 5
"""How many of a replica's newest versions the summary lists (`versions_held_summary`)."""


def versions_held_summary(held: list[int]) -> dict[str, Any]:
    """One replica's `replica_versions_held` entry, the same size whatever the run's length: `count` (the versions
    its current process held: the weights it loaded, then one per weight sync), `last` (the newest
    `VERSIONS_SHOWN`, oldest first) and `in_order` (they never went back)."""
    held = [int(v) for v in held]
    return {"count": len(held), "last": held[-VERSIONS_SHOWN:], "in_order": held == sorted(held)}


FAILURE_COUNTERS = ("failed_episodes", "dropped_groups", "resampled_episodes")
"""The collector's failure counters a step's record and the summary carry, with `failed_episodes/<cause>`."""


def failure_counters(col: dict[str, Any]) -> dict[str, Any]:
    """Of the collector's stats: failed samples (total and `failed_episodes/<cause>`), groups dropped for them,
    samples run again (rollout/failures.py), totals so far."""
    return {k: v for k, v in col.items() if k in FAILURE_COUNTERS or k.startswith("failed_episodes/")}


def backend_summary(*, collector: dict[str, Any], faults: Any, buffer: dict[str, Any], reward_failures: dict[str, Any],
                    versions_held: list[list[int]], transport: str | None, checksums_equal: bool,
                    reward_services: dict[str, Any]) -> dict[str, Any]:
    """`Backend.summary_stats`: the same keys from either backend (`collector`: its stats, whose failure counters
    the summary keeps: `failed_episodes`, and by cause in `episode_failures`; `faults`: its `FaultLedger`;
    `versions_held`: per replica, every version it generated with, which the summary holds as
    `versions_held_summary`: the summary line stays the same size however many steps the run took)."""
    failures = failure_counters(collector)
    return {"failed_episodes": failures.pop("failed_episodes", 0), "episode_failures": failures,
            **faults.summary(), "buffer": buffer,
            "reward_failures": reward_failures,
            "replica_versions_held": [versions_held_summary(h) for h in versions_held], "weight_transport": transport,
            "learner_checksums_equal_replicas": checksums_equal, "reward_services": reward_services}


class Backend(Protocol):
    """Blocking calls, each bounded by the job's timeouts. Built as `Backend(plan, model_path, task,
    tokenizer)` from the job's plan (`job.plan.JobPlan`). A checkpoint is written once, over five of them
    (`save_checkpoint`, `restore_checkpoint` below)."""

    faults: Any
    """The run's `FaultLedger`: a rollback returns to the last checkpoint's count of lost episodes."""

    @staticmethod
    def session() -> Any:
        """A context manager around a whole job run by `entry.train` (the Ray backend shuts down a local
        Ray it started)."""

    def train_step(self, batch: Any, loss: Any = None) -> dict[str, float]:
        """One optimizer update on every learner rank (`loss` None: the job's RL loss); rank 0's metrics,
        and under "trace" a few of its rows token by token when an engine sampled them (learner/trace_rows.py).
        `batch`: a TensorDict (the SFT warm start's) or a handle `next_batch` returned."""

    def reset_optimizer(self, optim_cfg: Any) -> None:
        """A fresh optimizer and schedule on every learner rank (after the SFT warm start)."""

    def sync_weights(self, version: int) -> dict[str, float]:
        """The learner's weights become `version` on every inference engine, and the collector is told the
        version (it admits episodes up to `max_staleness` older): `sync_s`, `stall_s`."""

    def start_collector(self) -> None:
        """Start (or resume) admitting episodes."""

    def next_batch(self, n_episodes: int, version: int) -> tuple[Any, dict[str, Any]]:
        """The buffer's oldest `n_episodes` within the staleness bound at `version` (waits, no polling),
        made a training batch where it is (`batch_prep.prepare_batch`: the frozen models `start_frozen`
        started score it, then the plan's stages run): (a handle `train_step` takes, its `step_metadata` plus
        `buffer_depth`, the episodes left in the buffer)."""

    def start_frozen(self, checkpoint: str | None) -> None:
        """The plan's frozen models (`JobPlan.frozen`): one started from the policy holds the current learner
        weights, or those `checkpoint` saved, without them passing through the driver; one of its own path loads it
        (again on a resume: it is in no checkpoint). `next_batch` scores every batch with those its stages need
        from then on (`{name}_s`: how long that took)."""

    def driver_bytes(self) -> int | None:
        """Bytes of data the driver received from the roles or sent them since the last call (None
        where the roles live in the driver's process and nothing crosses)."""

    def evaluate(self, progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
        """Greedy evaluation on the task's held-out prompts with the engines' current weights; `progress(n)` is
        called as answers come back (n answers each time)."""

    def collector_stats(self) -> dict[str, Any]:
        """The collector's counters (`tokens_per_s`, `failed_episodes`, ...)."""

    def drain(self) -> None:
        """Stop admitting and wait for the running episodes to land in the buffer."""

    def role_states(self) -> dict[str, Any]:
        """After `drain`: the states a checkpoint keeps besides the models', by role: `collector` (its data
        position), `buffer` (the episodes waiting). Raises RoleCrashed where a role is found dead: that
        checkpoint would keep what its death cost."""

    def load_role_states(self, states: dict[str, Any]) -> None:
        """Put what `role_states` returned back into the collector and the buffer (other keys are ignored)."""

    def save_models(self, path: str, extra: dict[str, Any]) -> None:
        """Write the learners' weights, optimizer, counters and RNG (with `extra`, which `load_models` returns) and
        each frozen model started from the policy (`FrozenSpec.saved`) into the directory `path`."""

    def load_models(self, path: str) -> dict[str, Any]:
        """Load a `save_models` directory into every learner rank; returns the `extra` it was saved with."""

    def summary_stats(self) -> dict[str, Any]:
        """The summary's backend part: buffer, failures, versions held, learner/engine checksums, and the
        reward-model scorers' batching figures (`reward_services`, {} without `reward.model`)."""

    def recover(self, crash: RoleCrashed) -> None:
        """Replace every role after `crash` (the driver then restores the last checkpoint into them)."""

    def publish(self, record: dict[str, Any]) -> None:
        """Export a step's record to the backend's monitoring (the Ray dashboard's metrics)."""

    def shutdown(self) -> None:
        """Release every role (processes, shared memory, sync groups)."""


def save_checkpoint(backend: Backend, path: str, step: int, version: int) -> str:
    """The job's checkpoint in the directory `path`, the same on every backend: no episode is running while it is
    taken (the collector drained, then started again), and it holds the models (learners, the frozen models
    started from the policy), the collector's data position, the buffer's episodes, `step` and `version`.
    A later rollback returns to it (`FaultLedger.checkpoint_taken`)."""
    backend.drain()
    backend.save_models(str(path), {"step": step, "version": version, **backend.role_states()})
    backend.start_collector()
    backend.faults.checkpoint_taken()
    return str(path)


def restore_checkpoint(backend: Backend, path: str) -> tuple[int, int]:
    """Load a `save_checkpoint` directory into every role; returns its (step, version)."""
    extra = backend.load_models(str(path))
    backend.load_role_states(extra)
    return extra["step"], extra["version"]
