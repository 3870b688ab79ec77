"""Build the job's parts from its config, once, the same way for every backend: task, sampling,
rollout workflow (the user's own, or the built-in one `rollout.workflow` names), episode filter."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import torch

from rayllm_rl.data.selectors import uniform_group_mask
from rayllm_rl.envs.task import Task
from rayllm_rl.envs.task_registry import make_task
from rayllm_rl.inference.protocol import SamplingParams
from rayllm_rl.job.checks import BUILTIN_WORKFLOWS
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.job.inputs import JobInputs
from rayllm_rl.object_path import import_object
from rayllm_rl.workflows.custom import CustomWorkflow
from rayllm_rl.workflows.rlvr import RLVRWorkflow


def build_task(cfg: GRPOJobConfig, inputs: JobInputs | None = None) -> Task:
    """The job's task with its rows, built once, on the driver, before any actor starts (a bad source, column or
    reward fails here): the registry's task `cfg.task`, or the custom one of `inputs` (None = the objects the
    config's import paths name). Env workers get its `worker_part()`."""
    inputs = inputs if inputs is not None else JobInputs.of(cfg)
    if inputs.task is None:
        task = make_task(cfg.task, cfg.data, cfg.trainer.seed, inputs)
    else:
        task = custom_task(cfg, inputs)
    if task.workflow is not None and (cfg.rollout.workflow != "auto" or inputs.workflow is not None):
        raise ValueError(f"task {task.name!r} plays its environment with its own workflow: leave rollout.workflow=auto "
                         f"(got {cfg.rollout.workflow!r}{' and a workflow= object' if inputs.workflow else ''})")
    if task.workflow is not None and cfg.reward.enabled:
        raise ValueError(f"task {task.name!r} is scored by its environment (and TRL-style reward functions): "
                         "reward.model / reward.judge are not combined with it; turn them off")
    if cfg.rollout.workflow == "env" and task.env_cls is None:
        raise ValueError(f"rollout.workflow=env needs a task with a ChatEnv; task {task.name!r} has none "
                         "(Task.env_cls): use rollout.workflow=rlvr or multi_turn")
    return task


def custom_task(cfg: GRPOJobConfig, inputs: JobInputs) -> Task:
    """The task given as an object or a factory (`factory(data_cfg, seed) -> Task`), checked: a Task with training
    rows holding the prompt chat in `messages`, its reward probed on the first one (all its fields as keywords)."""
    from rayllm_rl.envs.prompt_task import MESSAGES, chat_text
    from rayllm_rl.envs.task import in_memory
    from rayllm_rl.rewards.user_reward import probe

    made = inputs.task if isinstance(inputs.task, Task) else inputs.task(cfg.data, cfg.trainer.seed)
    if not isinstance(made, Task):
        raise ValueError(f"{inputs.task_label} returned a {type(made).__name__}, not a rayllm_rl.envs.task.Task")
    for part in ("train", "eval"):
        rows = getattr(made, part)
        if rows is None or MESSAGES not in rows.column_names or (part == "train" and len(rows) == 0):
            raise ValueError(f"{inputs.task_label}: its Task.{part} must be a datasets.Dataset with a {MESSAGES!r} "
                             f"column (each row's prompt chat){' and at least one row' if part == 'train' else ''}; "
                             f"got {None if rows is None else f'{len(rows)} rows with columns {rows.column_names}'}")
    first = made.train[0]
    probe(made.reward_fn, f"{inputs.task_label}'s reward_fn", chat_text(first[MESSAGES]), first)
    return dataclasses.replace(made, train=in_memory(made.train), eval=in_memory(made.eval))


def build_sampling(cfg: GRPOJobConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


PYTHON_TOOL_PROMPT = ("You may run Python: write a ```python block and its output comes back in <tool_response>. "
                      "Give the final answer without a code block.")


def local_python_tools() -> list:
    """Per-episode tools of the python_tool workflow in one process: a PythonSandbox run here. The
    Ray backend hands in `orchestration.ray.tool_services.ray_python_tools` instead (one shared service)."""
    from rayllm_rl.tools.python_interpreter import PythonInterpreter

    return [PythonInterpreter(done_when_no_code=True)]


def training_task(cfg: GRPOJobConfig, task: Task, reward_scorers: Mapping[str, Any] | None = None) -> Task:
    """`task` with the reward the policy trains on: its rule alone, or (with `reward.model` / `reward.judge`
    on) the rule, the reward model and the judge combined by their weights, over the backend's scorers."""
    if not cfg.reward.enabled:
        return task
    from rayllm_rl.rewards.combined import CombinedReward

    return task.with_reward(CombinedReward.from_config(cfg.reward, task.reward_fn, reward_scorers or {}))


def build_evaluation(cfg: GRPOJobConfig, task: Task, tokenizer) -> Callable[..., Any]:
    """`evaluation(engine, progress=None) -> awaitable {"eval_reward": ..., "eval_n": ..., ...}`: the held-out
    evaluation both backends run over their engine (or router), decided here once. A task that plays its own episodes
    (`Task.workflow`, task=openenv) plays one greedy episode of that workflow per held-out row (`evaluate_episodes`);
    every other task scores one greedy answer per prompt with its reward (`evaluate_greedy`)."""
    from rayllm_rl.workflows.evaluation import evaluate_episodes, evaluate_greedy

    if task.workflow is not None:
        workflow = build_workflow(cfg, task, tokenizer, evaluation=True)
        return lambda engine, progress=None: evaluate_episodes(engine, workflow, task.eval, progress)
    return lambda engine, progress=None: evaluate_greedy(engine, tokenizer, task.eval, task.reward_fn,
                                                         cfg.rollout.max_new_tokens, progress=progress)


def build_workflow(cfg: GRPOJobConfig, task: Task, tokenizer, make_tools: Callable[[], list] = local_python_tools,
                   reward_scorers: Mapping[str, Any] | None = None, custom: CustomWorkflow | None = None,
                   evaluation: bool = False):
    """The rollout workflow: the user's own (`custom`, the job's `JobInputs.workflow`) built with the job's
    keywords (`workflows.custom.JOB_KEYWORDS`), else the built-in one `rollout.workflow` names ('auto': the
    task's own workflow if it has one, `Task.workflow`, else its env if it has one). The one place that turns a
    workflow's name into a workflow.

    `make_tools()` builds one episode's tools for `python_tool`; `reward_scorers` ({"model": ..., "judge":
    ...}) score for `reward.*`; each backend hands in its own (in-process, or Ray actors), so nothing here
    asks which backend runs. `evaluation`: the held-out evaluation's copy, greedy and one sample a row."""
    task = training_task(cfg, task, reward_scorers)
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, greedy=True) if evaluation else build_sampling(cfg)
    offered = {"reward_fn": task.reward_fn, "tokenizer": tokenizer, "sampling": sampling,
               "group_size": 1 if evaluation else r.group_size, "max_turns": r.max_turns,
               "turn_discount": r.turn_discount,
               "sample_timeout_s": r.sample_timeout_s,
               "task": task.worker_part(), "config": cfg}
    if custom is not None:
        return custom.build(offered)
    kind = r.workflow
    if kind == "auto" and task.workflow is not None:  # the task plays its own environment (task=openenv)
        return CustomWorkflow(task.workflow, label=f"task {task.name!r}'s workflow").build(offered)
    if kind not in BUILTIN_WORKFLOWS:
        raise ValueError(f"rollout.workflow={kind!r} is not a built-in workflow {list(BUILTIN_WORKFLOWS)}, and no "
                         "workflow of your own was handed in (JobInputs.workflow: rollout.workflow=package.module:Name "
                         "imported, or train(workflow=...))")
    if kind == "auto":
        kind = "env" if task.make_env is not None else "rlvr"
    if kind == "env":
        if task.make_env is None:
            raise ValueError(f"task {task.name!r} has no ChatEnv; use rollout.workflow=rlvr or multi_turn")
        from rayllm_rl.workflows.chat_env_workflow import ChatEnvWorkflow

        make_env = functools.partial(task.make_env, tokenizer, seed=cfg.trainer.seed)
        return ChatEnvWorkflow(make_env, sampling, group_size=offered["group_size"], max_turns=r.max_turns)
    if kind == "openai_agent":
        from rayllm_rl.agents.openai_workflow import OpenAIAgentWorkflow

        if not r.agent:
            raise ValueError("rollout.workflow=openai_agent needs rollout.agent='package.module:async_function'")
        return OpenAIAgentWorkflow(import_object(r.agent), tokenizer, group_size=offered["group_size"],
                                   reward_fn=task.reward_fn, max_tokens=r.max_new_tokens, sampling=sampling)
    if kind == "python_tool":
        from rayllm_rl.agents.tool_agent import ToolAgentWorkflow

        return ToolAgentWorkflow(tokenizer, make_tools, sampling, reward_fn=task.reward_fn,
                                 system_prompt=PYTHON_TOOL_PROMPT, group_size=offered["group_size"],
                                 max_turns=max(r.max_turns, 1))
    if kind == "multi_turn":
        from rayllm_rl.workflows.grouped import GroupedWorkflow
        from rayllm_rl.workflows.multi_turn import MultiTurnWorkflow

        agent = MultiTurnWorkflow(task.reward_fn, tokenizer, sampling, max_turns=max(r.max_turns, 1),
                                  turn_discount=r.turn_discount)
        return GroupedWorkflow(agent, offered["group_size"], timeout_s=r.sample_timeout_s)
    return RLVRWorkflow(task.reward_fn, tokenizer, sampling, group_size=offered["group_size"])


def has_reward_variance(episode) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal.

    The episode is one group (all its rows); "uniform" is `uniform_group_mask`'s test, the one
    `drop_uniform_groups` uses (exact comparison, a singleton group is uniform).
    """
    r = episode["rewards"]
    return not bool(uniform_group_mask(r, torch.zeros_like(r, dtype=torch.long)).all())


def build_episode_filter(cfg: GRPOJobConfig):
    return has_reward_variance if cfg.algo.dynamic_sampling else None
