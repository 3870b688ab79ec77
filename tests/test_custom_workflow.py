"""A rollout workflow of the user's own: `rollout.workflow=package.module:Name` and `train(workflow=...)`.

Bad input fails before anything starts, naming the key; a custom workflow's episodes are checked where the env
worker stores them (missing keys, unversioned trained tokens, another group's id fail naming them); a workflow
defined inside a test trains on the local backend and, shipped by value, in Ray env workers."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rayllm_rl.config import load_config
from rayllm_rl.data.trajectory import make_trajectory
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.inputs import JobInputs
from rayllm_rl.rollout.collector import run_and_store

ROWS = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a in range(6) for b in range(6)]


def exact(prompt, completion, prompt_ids, completion_ids, answer, **columns):
    return float(completion.strip().endswith(str(answer)))


def validated(overrides, **objects):
    """The config `train` would run, validated with the job's objects (what fails here fails before any actor)."""
    cfg = load_config(GRPOJobConfig, ["data.eval_size=4", *overrides])
    inputs = JobInputs.of(cfg, reward_fn=exact, train_dataset=ROWS, **objects)
    return cfg.validate(inputs=inputs), inputs


# ---------------------------------------------------------------- checked before anything starts


@pytest.mark.parametrize("overrides, objects, message", [
    (["rollout.workflow=no_such_pkg.flows:Mine"], {},
     r"cannot import rollout.workflow='no_such_pkg.flows:Mine': No module named 'no_such_pkg'"),
    (["rollout.workflow=workflow_helpers:Sizd"], {},
     r"module 'workflow_helpers' has no attribute 'Sizd'; close names: \['Sized'\]"),
    (["rollout.workflow=multiturn"], {}, r"rollout.workflow='multiturn' is neither a built-in workflow .* \(close: "
                                         r"\['multi_turn'\]\) nor an import path"),
    (["rollout.workflow=workflow_helpers:NoEpisode"], {},
     r"rollout.workflow='workflow_helpers:NoEpisode': NoEpisode has no async def arun_episode"),
    (["rollout.workflow=workflow_helpers:SyncEpisode"], {}, r"SyncEpisode has no async def arun_episode"),
    (["rollout.workflow=workflow_helpers:NeedsPath"], {},
     r"its parameter 'data_dir' has no default and is none of the keywords the job passes \(reward_fn, tokenizer, "
     r"sampling, group_size, max_turns, turn_discount, sample_timeout_s, task, config\); give it a default or set it "
     r"in rollout.workflow_kwargs"),
    (["rollout.workflow=workflow_helpers:Sized", "rollout.workflow_kwargs.bonsu=1"], {},
     r"rollout.workflow_kwargs sets \['bonsu'\], which rollout.workflow='workflow_helpers:Sized' does not take"),
    (["rollout.workflow=workflow_helpers:Sized", "rollout.workflow_kwargs.group_size=2"], {},
     r"rollout.workflow_kwargs sets \['group_size'\], which the job passes .* set the job's keys instead"),
    (["rollout.workflow=workflow_helpers:Sized", "rollout.workflow_kwargs.bonus=lots"], {},
     r"rollout.workflow_kwargs.bonus.*expected a float, got 'lots'"),
    (["rollout.workflow=rlvr", "rollout.workflow_kwargs.bonus=1"], {},
     r"are the keyword arguments of a workflow of your own .* rollout.workflow='rlvr' is not one"),
    (["rollout.workflow=workflow_helpers:Sized", "rollout.max_turns=3"], {},
     r"rollout.max_turns=3 is not read by rollout.workflow='workflow_helpers:Sized': its class or factory takes no "
     r"'max_turns' keyword"),
    (["rollout.workflow=rlvr"], {"workflow": "workflow_helpers:Sized"},
     r"workflow= \(a Python object\) and rollout.workflow='rlvr' both name the workflow: give one"),
    (["rollout.workflow=python:Sized"], {}, r"names a workflow given as a Python object, and none was given"),
    ([], {"workflow": 42}, r"workflow= \(int\) is a int: expected a class or factory"),
    (["rollout.workflow_kwargs.bonus=1"], {"workflow": "workflow_helpers:Sized", "workflow_kwargs": {"bonus": 2}},
     r"workflow_kwargs= and rollout.workflow_kwargs=\{'bonus': '1'\} both give"),
])
def test_bad_workflows_fail_before_anything_starts_naming_the_key(overrides, objects, message):
    import workflow_helpers

    if isinstance(objects.get("workflow"), str):
        objects = {**objects, "workflow": getattr(workflow_helpers, objects["workflow"].split(":")[1])}
    with pytest.raises((ValueError, TypeError), match=message):
        validated(overrides, **objects)


def test_import_path_and_object_resolve_with_typed_kwargs():
    from workflow_helpers import Sized, make_sized

    cfg, inputs = validated(["rollout.workflow=workflow_helpers:Sized", "rollout.workflow_kwargs.bonus=2.5"])
    assert cfg.rollout.workflow == "workflow_helpers:Sized" and inputs.workflow.source is Sized
    assert inputs.workflow.kwargs == {"bonus": 2.5}  # command-line text, typed as the parameter's default
    assert [k for k in ("reward_fn", "tokenizer", "sampling", "group_size", "max_turns", "task")
            if inputs.workflow.takes(k)] == ["reward_fn", "tokenizer", "sampling", "group_size"]
    cfg, inputs = validated(["rollout.max_turns=3"], workflow=make_sized, workflow_kwargs={"anything": 1})
    assert cfg.rollout.workflow == "python:make_sized"  # config.json names the object
    assert inputs.workflow.takes("max_turns") and inputs.workflow.label == "workflow= (make_sized)"


# ---------------------------------------------------------------- episodes checked where they are stored


class Returns:
    """A user's workflow returning a fixed object (the subject of these checks)."""

    def __init__(self, out):
        self.out = out

    async def arun_episode(self, engine, data):
        return self.out


def two_rows(group_id: int = 7) -> TensorDict:
    from rayllm_rl.data.trajectory import concat_padded

    return concat_padded([make_trajectory([1, 2, 3], [0.0, -0.5, -0.7], [0, 1, 1], [-1, 0, 0], 1.0, group_id),
                          make_trajectory([1, 2], [0.0, -0.2], [0, 1], [-1, 0], 0.0, group_id)])


def store(out, group_id: int = 7):
    stored = []

    async def put(td):
        stored.append(td)

    outcome = asyncio.run(run_and_store(Returns(out), None, {"group_id": group_id}, put))
    return outcome, stored


@pytest.mark.parametrize("broken, message", [
    (lambda td: td.exclude("versions", "rewards"), r"Returns.arun_episode returned an episode missing the keys "
                                                   r"\['versions', 'rewards'\]"),
    (lambda td: td.set("versions", torch.full_like(td["versions"], -1)),
     r"Returns.arun_episode returned 3 trained tokens \(loss_mask 1\) with no policy version"),
    (lambda td: td.set("group_id", torch.tensor([7, 8])), r"trajectories with group_id \[7, 8\] for a row of group 7"),
    (lambda td: td.set("rewards", torch.tensor([1.0, float("nan")])), r"non-finite rewards"),
    (lambda td: td.set("logprobs", torch.zeros(2, 5)), r"an invalid episode: trajectory key 'logprobs' has shape"),
    (lambda td: [td], r"returned a list, not a TensorDict \(or None to reject it\)"),
])
def test_an_episode_breaking_the_contract_fails_naming_the_problem(broken, message):
    with pytest.raises(ValueError, match=message):
        store(broken(two_rows()))


def test_none_rejects_an_episode_and_a_dict_of_tensors_is_stored_with_the_contract_dtypes():
    outcome, stored = store(None)
    assert (outcome.accepted, stored) == (False, [])  # AReaL: None drops the episode
    plain = {k: (v.long() if k == "loss_mask" else v) for k, v in two_rows().items()}
    outcome, stored = store(plain)
    assert outcome.accepted and outcome.generated_tokens == 3
    assert stored[0]["loss_mask"].dtype == torch.bool and stored[0].batch_size[0] == 2


# ---------------------------------------------------------------- training with a workflow of one's own


def job(tmp_path, *extra):
    return ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.max_new_tokens=4",
            "data.eval_size=4", "sft.steps=0", "trainer.eval_every=0", f"trainer.run_dir={tmp_path}",
            "trainer.call_timeout_s=120", *extra]


def rl_records(summary) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def local_workflow():
    """A workflow class made inside a function, as in a notebook: no worker could import it (Ray pickles it by
    value). It is the built-in single-turn workflow recording what the job handed it: `made_group_size` (the
    `group_size` keyword), `bonus` (a `workflow_kwargs` entry) and `made_here` on every trajectory."""
    from rayllm_rl.workflows.rlvr import RLVRWorkflow

    class Doubled(RLVRWorkflow):
        def __init__(self, reward_fn, tokenizer, sampling, group_size: int, bonus: float = 0.0):
            super().__init__(reward_fn, tokenizer, sampling, group_size=group_size)
            self.bonus = bonus

        async def arun_episode(self, engine, data):
            td = await super().arun_episode(engine, data)
            for key, value in (("made_group_size", self.group_size), ("bonus", self.bonus), ("made_here", 1.0)):
                td[key] = td["rewards"] * 0 + float(value)
            return td

    return Doubled


def test_a_workflow_object_trains_on_the_local_backend_with_the_jobs_keywords(tmp_path):
    from rayllm_rl import GRPOTrainer

    summary = GRPOTrainer(reward_funcs=exact, train_dataset=ROWS, workflow=local_workflow(),
                          workflow_kwargs={"bonus": 0.25}, args=job(tmp_path, "trainer.backend=local")).train()
    assert (summary["steps"], summary["version"], summary["failed_episodes"]) == (2, 2, 0)
    for record in rl_records(summary):  # every trajectory came from the user's class, built with the job's keywords
        assert (record["made_group_size"], record["bonus"], record["made_here"], record["seqs"]) == (3.0, 0.25, 1.0, 6)
    config = json.loads((Path(summary["run_dir"]) / "config.json").read_text())
    assert config["rollout"]["workflow"] == "python:Doubled"
    assert summary["reward_failures"]["reward_calls"] >= 2 * 2 * 3  # its RewardCaller's counters are reported


def test_a_workflow_whose_episodes_miss_keys_fails_the_job_naming_them(tmp_path):
    from rayllm_rl import train

    class DropsVersions:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        async def arun_episode(self, engine, data):
            return make_trajectory([1, 2], [0.0, -1.0], [0, 1], [-1, 0], 0.0, data["group_id"]).exclude("versions")

    with pytest.raises(RuntimeError, match=r"DropsVersions.arun_episode returned an episode missing the keys "
                                           r"\['versions'\]"):
        train(overrides=job(tmp_path, "trainer.backend=local"), reward_fn=exact, train_dataset=ROWS,
              workflow=DropsVersions)


@pytest.mark.ray
@pytest.mark.slow
def test_a_workflow_defined_in_the_test_reaches_the_ray_env_workers_by_value_and_a_callback_runs_on_the_driver(
        tmp_path):
    """The user's own pieces on the Ray backend, one job: the workflow and the reward, defined here, reach the env
    workers by value; a callback defined here holds a lock (it could not be pickled to a worker), so it runs in
    this process, sees every step's record and stops the run at step 2 (checkpoint, summary) as trainer.steps would.
    train() starts its own local Ray and shuts it down. (A job on a Ray the user started leaves it running:
    test_user_task_jobs.)"""
    import threading

    import ray

    from rayllm_rl import train
    from rayllm_rl.callbacks import Callback
    from rayllm_rl.orchestration.reporting import SUMMARY_KEYS
    from test_callbacks import as_logged, logged

    def ends_with_answer(prompt, completion, prompt_ids, completion_ids, answer, **columns):  # by value, too
        return float(completion.strip().endswith(str(answer)))

    seen, lock = [], threading.Lock()

    class StopAtTwo(Callback):
        def on_step_end(self, record, control):
            with lock:
                seen.append(record)
            if record["step"] == 2:
                control.stop("enough")

    flow = local_workflow()
    assert "<locals>" in flow.__qualname__ and not ray.is_initialized()
    summary = train(overrides=job(tmp_path, "trainer.steps=4", "ray.sync_timeout_s=60", "ray.dashboard=false"),
                    reward_fn=ends_with_answer, train_dataset=ROWS, workflow=flow, workflow_kwargs={"bonus": 0.5},
                    callbacks=[StopAtTwo()])
    assert not ray.is_initialized()  # the job's own Ray, shut down with it
    assert (summary["backend"], summary["steps"], summary["failed_episodes"]) == ("ray", 2, 0)
    assert [(r["made_group_size"], r["bonus"], r["made_here"]) for r in rl_records(summary)] == [(3.0, 0.5, 1.0)] * 2
    assert summary["reward_failures"]["reward_calls"] >= 2 * 2 * 3  # counted by the env workers' RewardCallers
    assert set(summary) == SUMMARY_KEYS and summary["version"] == 2
    assert Path(summary["checkpoint"]).name == "step_2" and Path(summary["checkpoint"]).is_dir()
    assert summary["callback_errors"] == {"StopAtTwo": 0}
    assert summary["stopped_by"] == {"callback": "StopAtTwo", "hook": "on_step_end", "step": 2, "reason": "enough"}
    assert [as_logged(r) for r in seen] == logged(summary, "rl") and [r["step"] for r in seen] == [1, 2]


def test_an_instance_too_big_for_the_env_workers_fails_before_ray_starts(tmp_path):
    import ray

    from rayllm_rl import train

    class Heavy:
        table = None

        async def arun_episode(self, engine, data):
            return None

    heavy = Heavy()
    heavy.table = bytes(300_000)
    with pytest.raises(ValueError, match=r"env worker: constructor argument 0 \(the workflow of workflow= \(Heavy\)\) "
                                         r"pickles to \d+ bytes.*pass a class or factory"):
        train(overrides=job(tmp_path), reward_fn=exact, train_dataset=ROWS, workflow=heavy)
    assert not ray.is_initialized()


def test_the_readme_workflow_example_is_a_valid_workflow(engine, tokenizer):
    """README's "From Python" workflow, run as written against the tiny engine: it passes the checks and returns a
    group the buffer accepts."""
    from rayllm_rl.data.trajectory import check_episode
    from rayllm_rl.inference.protocol import SamplingParams
    from rayllm_rl.workflows.custom import CustomWorkflow

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in readme.split("```python")[1:] if "class BestOfN" in b).split("```")[0]
    namespace: dict = {}
    exec(block.split("summary = train(")[0], namespace)  # noqa: S102 - the README's own code
    spec = CustomWorkflow(namespace["BestOfN"], label="BestOfN")
    spec.check()
    wf = spec.build({"reward_fn": exact, "tokenizer": tokenizer, "sampling": SamplingParams(max_new_tokens=4),
                     "group_size": 3, "max_turns": 1, "task": None, "config": None})
    td = check_episode(asyncio.run(wf.arun_episode(engine, {**ROWS[0], "group_id": 4})), 4, "BestOfN")
    assert td.batch_size[0] == 3 and td["group_id"].tolist() == [4, 4, 4] and int(td["loss_mask"].sum()) > 0
