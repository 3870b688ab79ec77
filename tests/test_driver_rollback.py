"""The driver's rollback paths, without Ray or processes: a scripted backend raises RoleCrashed where a
test says, and otherwise keeps what a real backend keeps (checkpointed step, version and data position,
the fault ledger). A crash rolls back to the last checkpoint; running out of recoveries, or a crash
before the first checkpoint, fails the run with the crash."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rayllm_rl.config import load_config
from rayllm_rl.data.trajectory import concat_padded, make_trajectory
from job_helpers import run_job
from rayllm_rl.orchestration import driver
from rayllm_rl.orchestration.backend import ROLE_KINDS, RoleCrashed
from rayllm_rl.algorithm.batch_prep import make_batch_pipeline, step_metadata
from rayllm_rl.orchestration.fault_ledger import LOST, RERUN, FaultLedger
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.orchestration.reporting import SUMMARY_KEYS

B, G = 2, 2  # episodes per step, rows per episode


class ScriptedBackend:
    """`Backend` in memory. `crashes` maps (method, n) to the roles whose death the n-th call (1-based) of
    `method` reports; `faults` maps a `next_batch` call number to collector fault events seen then."""

    def __init__(self, plan, tokenizer, crashes: dict[tuple[str, int], list[str]],
                 faults: dict[int, list] | None = None):
        self.plan, self.cfg, self.frozen = plan, plan.config, ()
        self.tokenizer = tokenizer
        self.crashes, self.fault_script = crashes, faults or {}
        self.calls: dict[str, list] = {}
        self.checkpoints: dict[str, dict] = {}  # path -> what save_models was given
        self.faults = FaultLedger(ROLE_KINDS)
        self.next_group = 0  # the collector's data position: a restore puts it back
        self.version = -1  # the engines' weights

    def _call(self, method: str, *args) -> None:
        self.calls.setdefault(method, []).append(args)
        roles = self.crashes.get((method, len(self.calls[method])))
        if roles:
            raise RoleCrashed(roles, RuntimeError(f"scripted crash in {method}"))

    def count(self, method: str) -> int:
        return len(self.calls.get(method, []))

    def train_step(self, batch, loss=None):
        self._call("train_step", batch.batch_size[0])
        return {"loss": 0.5}

    def reset_optimizer(self, optim_cfg) -> None:
        self._call("reset_optimizer")

    def sync_weights(self, version: int):
        self._call("sync_weights", version)
        self.version = version
        return {"sync_s": 0.01, "stall_s": 0.0}

    def start_collector(self) -> None:
        self._call("start_collector")

    def next_batch(self, n_episodes: int, version: int):
        self._call("next_batch", version)
        self.faults.record(self.fault_script.get(self.count("next_batch"), []))
        episodes = []
        for _ in range(n_episodes):
            gid, self.next_group = self.next_group, self.next_group + 1
            episodes += [make_trajectory([5, 6 + gid % 7, 9, 10], [0.0, 0.0, -1.0, -1.0], [0, 0, 1, 1],
                                         [-1, -1, version, version], reward=float(r), group_id=gid) for r in range(G)]
        batch = concat_padded(episodes)
        scored = {"ref_logprobs": torch.zeros(batch["input_ids"].shape)} if "reference" in self.frozen else {}
        batch = make_batch_pipeline(self.cfg, self.frozen)(batch, version, scored)
        meta = step_metadata(batch, version)
        return batch, {**meta, "buffer_depth": 0}

    def start_frozen(self, checkpoint):
        self._call("start_frozen", checkpoint)
        self.frozen = self.plan.frozen_names()

    def driver_bytes(self):
        return None

    def evaluate(self, progress=None):
        self._call("evaluate")
        return {"eval_reward": 0.25 if self.version <= 0 else 0.5}

    def collector_stats(self):
        return {"tokens_per_s": 100.0, "failed_episodes": 0}

    def save_models(self, path: str, extra: dict) -> None:
        self._call("save_models", path)
        self.checkpoints[path] = extra

    def load_models(self, path: str) -> dict:
        self._call("load_models", path)
        return self.checkpoints[path]

    def role_states(self) -> dict:
        return {"collector": {"next_group": self.next_group}, "buffer": {}}

    def load_role_states(self, states: dict) -> None:
        self.next_group = states["collector"]["next_group"]

    def drain(self) -> None:
        self._call("drain")

    def summary_stats(self):
        return {"failed_episodes": 0, "episode_failures": {}, **self.faults.summary(), "buffer": {},
                "reward_failures": {},
                "replica_versions_held": [], "weight_transport": "in-process", "learner_checksums_equal_replicas": True,
                "reward_services": {}}

    def recover(self, crash: RoleCrashed) -> None:
        self._call("recover", *crash.roles)
        self.faults.rolled_back(crash.roles)

    def publish(self, record) -> None:
        pass

    def shutdown(self) -> None:
        self._call("shutdown")


def run(tmp_path, monkeypatch, crashes, *overrides, faults=None, callbacks=None):
    """Run the real driver on a ScriptedBackend; returns (backend, summary or the exception raised)."""
    cfg = load_config(GRPOJobConfig, ["trainer.backend=local", "sft.steps=0", "data.eval_size=4",
                                      f"rollout.prompts_per_step={B}", f"rollout.group_size={G}",
                                      "trainer.eval_every=0", f"trainer.run_dir={tmp_path}", *overrides])
    made = []
    monkeypatch.setattr(driver, "open_backend",
                        lambda plan, model_path, task, tokenizer, workflow=None:
                        made.append(ScriptedBackend(plan, tokenizer, crashes, faults)) or made[0])
    try:
        out = run_job(cfg.validate(), callbacks=callbacks)
    except RoleCrashed as exc:
        out = exc
    return made[0], out


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_crash_rolls_back_to_the_last_checkpoint_and_the_run_finishes(tmp_path, monkeypatch):
    # step 3 trains (checkpoint at step 2), then step 4's batch wait finds learner-0 dead
    backend, summary = run(tmp_path, monkeypatch, {("next_batch", 4): ["learner-0"]},
                           "trainer.steps=6", "trainer.checkpoint_every=2",
                           faults={2: [(RERUN, 3)], 3: [(LOST, 4), (LOST, 5)]})
    assert set(summary) == SUMMARY_KEYS and summary["steps"] == 6 and summary["version"] == 6
    step_2 = str(Path(summary["run_dir"]) / "checkpoints" / "step_2")
    assert summary["recoveries"] == [{"roles": ["learner-0"], "at_step": 3, "resumed_from": step_2}]
    assert backend.calls["recover"] == [("learner-0",)] and backend.calls["load_models"] == [(step_2,)]
    # the learner restart is counted; the 2 episodes lost after the checkpoint are redone: re-runs, not losses
    assert summary["restarts"] == {**dict.fromkeys(ROLE_KINDS, 0), "learner": 1}
    assert summary["episodes_lost"] == 0 and summary["episodes_rerun"] == 1 + 2
    # after the restore: weights of version 2 to the engines, then versions 3..6; eval before is not redone
    assert [v for (v,) in backend.calls["sync_weights"]] == [0, 1, 2, 3, 2, 3, 4, 5, 6]
    # the collector starts after the first eval and after the rollback, and again after each checkpoint
    assert backend.count("evaluate") == 2 and backend.count("start_collector") == 2 + backend.count("save_models")
    rl = [r for r in records(summary["run_dir"]) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3, 3, 4, 5, 6]  # step 3 is trained again from the checkpoint
    assert rl[2]["episode_ids"] == rl[3]["episode_ids"] == [4, 5]  # from the same data position
    assert [r["episode_ids"] for r in rl[3:]] == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert backend.count("shutdown") == 1


def test_out_of_recoveries_the_crash_fails_the_run(tmp_path, monkeypatch):
    crashes = {("next_batch", 3): ["collector"], ("train_step", 4): ["replay-buffer"]}
    backend, out = run(tmp_path, monkeypatch, crashes, "trainer.steps=6", "trainer.checkpoint_every=1",
                       "trainer.max_recoveries=1")
    assert isinstance(out, RoleCrashed) and out.roles == ["replay-buffer"]  # the second crash, unrecovered
    assert backend.calls["recover"] == [("collector",)]  # only the first one was
    assert backend.count("shutdown") == 1  # the roles are released all the same
    logged = records(tmp_path / next(p.name for p in tmp_path.iterdir()))
    assert [r["at_step"] for r in logged if r["phase"] == "recovery"] == [2]
    assert not any(r["phase"] == "rl" and r["step"] > 3 for r in logged)


def test_no_recovery_allowed_fails_at_the_first_crash(tmp_path, monkeypatch):
    backend, out = run(tmp_path, monkeypatch, {("train_step", 2): ["learner-1"]}, "trainer.steps=4",
                       "trainer.max_recoveries=0")
    assert isinstance(out, RoleCrashed) and out.roles == ["learner-1"]
    assert backend.count("recover") == 0 and backend.count("load_models") == 0 and backend.count("shutdown") == 1


@pytest.mark.parametrize("method,overrides", [
    ("sync_weights", []),                    # the first weight sync, before the first checkpoint
    ("evaluate", []),                        # the first evaluation
    ("train_step", ["sft.steps=3"]),         # the SFT warm start
])
def test_a_crash_before_the_first_checkpoint_fails_the_run(tmp_path, monkeypatch, method, overrides):
    """Nothing to roll back to: the crash is raised even with recoveries left."""
    backend, out = run(tmp_path, monkeypatch, {(method, 1): ["inference-0"]}, "trainer.steps=3",
                       "trainer.max_recoveries=3", *overrides)
    assert isinstance(out, RoleCrashed) and out.roles == ["inference-0"]
    assert backend.count("save_models") == 0 and backend.count("recover") == 0
    assert backend.count("next_batch") == 0 and backend.count("shutdown") == 1


def test_a_callbacks_stop_holds_across_a_rollback(tmp_path, monkeypatch):
    """A callback stops the run at step 2, before step 2's periodic checkpoint; the final drain (the third: each
    checkpoint drains first) finds the collector dead, so the run rolls back to step 0's checkpoint, trains steps 1
    and 2 again and stops there."""
    from rayllm_rl.callbacks import Callback

    class StopAtTwo(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, record, control):
            self.seen.append(record["step"])
            control.should_training_stop = record["step"] == 2

    stopper = StopAtTwo()
    backend, summary = run(tmp_path, monkeypatch, {("drain", 3): ["collector"]}, "trainer.steps=6",
                           "trainer.checkpoint_every=2", callbacks=[stopper])
    ckpts = [str(Path(summary["run_dir"]) / "checkpoints" / f"step_{n}") for n in (0, 2)]
    assert summary["steps"] == 2 and summary["version"] == 2 and stopper.seen == [1, 2, 1, 2]
    assert summary["stopped_by"] == {"callback": "StopAtTwo", "hook": "on_step_end", "step": 2, "reason": ""}
    assert summary["recoveries"] == [{"roles": ["collector"], "at_step": 2, "resumed_from": ckpts[0]}]
    # no periodic save at the step that stopped: step 2 is saved once per pass, as the final checkpoint
    assert [p for (p,) in backend.calls["save_models"]] == [ckpts[0], ckpts[1], ckpts[1]]
    # a drain before each of the 3 checkpoints, and the final drain of each pass
    assert [v for (v,) in backend.calls["sync_weights"]] == [0, 1, 2, 0, 1, 2] and backend.count("drain") == 3 + 2
