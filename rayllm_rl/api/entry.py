"""`train(config, overrides, **objects)`: one entry point for a job, from `jobs/grpo.py` or from Python.

Gathers the job's Python objects (`JobInputs`), makes the job's plan once (`job.plan.make_plan`), runs it on
the backend the plan names, and returns the same JSON-able summary the job prints. Its two halves: `prepare`
(the validation, nothing started) and `run_plan` (the job).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from rayllm_rl.job.config import GRPOJobConfig


def train(config: GRPOJobConfig | None = None, overrides: list[str] | None = None, *,
          callbacks: list | None = None, reward_fn: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
          reward_weights: Sequence[float] | None = None, train_dataset: Any = None, eval_dataset: Any = None,
          task: Any = None, workflow: Any = None, workflow_kwargs: Mapping[str, Any] | None = None,
          environment: Any = None) -> dict:
    """Validate the config (before any actor starts), run it, return the summary.

    `overrides` are `key.sub=value` strings applied on top of `config` (or of the defaults).
    Fields left None take the task's preset (`presets.resolve_presets`, run by `validate`, which returns
    a new config: `config` itself is left as it was): values set in `config` (YAML, command line, Python
    assignment) or `overrides` win, even one equal to a preset. Pass the config as loaded (`load_config`),
    not a `validate()`d one, whose filled values all count as the user's. With the Ray
    backend a local Ray started here is shut down at the end; a Ray the caller had already
    initialised (or `ray.address`) is left running. The HF libraries' progress bars are off during the
    run (the job's console holds one bar) and put back as they were. `callbacks`: Callback objects
    (callbacks.py) called on this process after each step and evaluation, before those
    `trainer.callbacks` names; one that raises is counted in the summary's `callback_errors`.

    Objects instead of import paths (`JobInputs`), each reaching the Ray env workers by value (a function
    defined in your script or notebook too):
    - `reward_fn`: the reward of the prompt task, a callable or a list of them (`reward.fn`), each
      `fn(prompt, completion, prompt_ids, completion_ids, **columns) -> float | {"reward": float, ...}`, sync
      or async; with `task` unset the job trains `task=prompts` on `train_dataset` (or `data.path`);
    - `reward_weights`: one weight per reward function (`reward.fn_weights`; default all 1.0);
    - `train_dataset` / `eval_dataset`: a `datasets.Dataset` or a list of dicts, in place of `data.path` /
      `data.eval_path`, checked as files are;
    - `task`: a `Task` (with its rows) or a factory `factory(data_cfg, seed) -> Task`, in place of `task=`;
    - `workflow`: a rollout workflow of your own, in place of `rollout.workflow=package.module:Name`: a class or
      factory called in each env worker with the keywords it names of `reward_fn, tokenizer, sampling,
      group_size, max_turns, turn_discount, task, config` (`workflows.custom.JOB_KEYWORDS`) plus
      `workflow_kwargs`, returning an object with `async arun_episode(engine, data) -> TensorDict`; or such an
      object itself (pickled to each worker: keep it small). docs/extending.md has the contract;
    - `environment`: the environment `task=openenv` plays (task unset: it is set), in place of `data.openenv.env`:
      an OpenEnv `Environment` subclass or a TRL `environment_factory` class; or a verifiers `Environment` instance,
      which `task=verifiers` plays, in place of `data.verifiers.env_id` (docs/environments.md).
    """
    plan, inputs = prepare(config, overrides, reward_fn=reward_fn, reward_weights=reward_weights,
                           train_dataset=train_dataset, eval_dataset=eval_dataset, task=task, workflow=workflow,
                           workflow_kwargs=workflow_kwargs, environment=environment)
    return run_plan(plan, inputs, callbacks=callbacks)


def prepare(config: GRPOJobConfig | None = None, overrides: list[str] | None = None, **objects: Any):
    """`train`'s first half: the overrides applied, the job's objects gathered (`JobInputs`, `objects` are `train`'s
    keywords but `callbacks`) and its plan made (the validation): `(plan, inputs)`. Nothing is started or loaded, so
    whatever this raises is a config error (the command line says it in one message, `cli.job_main`)."""
    from rayllm_rl.config import apply_dict, parse_overrides
    from rayllm_rl.job.inputs import JobInputs
    from rayllm_rl.job.plan import make_plan

    cfg = config if config is not None else GRPOJobConfig()
    if overrides:
        cfg = apply_dict(cfg, parse_overrides(list(overrides)))
    inputs = JobInputs.of(cfg, **objects)
    return make_plan(cfg, inputs), inputs  # the validation: a new config, the presets filled, each decision made once


def run_plan(plan, inputs, *, callbacks: list | None = None) -> dict:
    """`train`'s second half: run the job of `prepare`'s plan on its backend; returns the summary."""
    from rayllm_rl.orchestration.driver import train as run_driver
    from rayllm_rl.orchestration.reporting import hf_progress_bars_off

    # the job's console holds one bar: no "Map"/"Flattening"/download/"Loading weights" bars from the HF
    # libraries in this process (actors start with HF_HUB_DISABLE_PROGRESS_BARS=1); put back after the run
    with hf_progress_bars_off(), plan.backend_class().session():
        return run_driver(plan, inputs, callbacks=callbacks)
