"""`JobInputs`: the Python objects a job uses beside its config, gathered once and handed down as one object.

`train(config, overrides, *, reward_fn=..., train_dataset=..., ...)` (and `GRPOTrainer`) take objects: reward
functions, datasets, a task. The config names some of the same things by import path (`reward.fn`,
`task=package.module:factory`). `JobInputs.of(cfg, **objects)` imports those paths (an import that fails
names the key and what is missing) and checks the objects, so everything below (presets, checks, the
task's factory) sees objects only. The config itself never holds an object: it is logged, pickled to
every actor and printed by the dry run. A new keyword of `train` is one more field here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from rayllm_rl.object_path import import_object


@dataclasses.dataclass(frozen=True)
class JobInputs:
    """What a job was given as objects (or imported from the config's paths)."""

    reward_fns: tuple[Callable[..., Any], ...] = ()
    """The prompt task's reward functions (`reward.fn` imported, or `reward_fn=`)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward function (`reward.fn_weights` or `reward_weights=`); () = all 1.0."""
    reward_labels: tuple[str, ...] = ()
    """How errors name each reward function: "reward.fn[0]='m:f'" or "reward_fn[0] (f)"."""
    train_dataset: Any = None
    """Training rows given in Python (a `datasets.Dataset` or a list of dicts), in place of `data.path`."""
    eval_dataset: Any = None
    """Held-out rows given in Python, in place of `data.eval_path`."""
    task: Any = None
    """A custom task: a `Task` (with its rows), or a factory `factory(data_cfg, seed) -> Task` (`task=` given in
    Python, or `task=package.module:factory` imported); None = the registry's task `cfg.task`."""
    task_label: str = ""
    """How errors name the custom task ("task='m:f'" or "task= (its name)")."""
    python_task: str = ""
    """The name of a task given as an object: `task` resolves to "python:<it>" (a Task's name, a factory's)."""
    workflow: Any = None
    """A rollout workflow of the user's own (`workflows.custom.CustomWorkflow`: the class, factory or instance and
    its keyword arguments), from `train(workflow=..., workflow_kwargs=...)` or `rollout.workflow=package.module:Name`
    imported; None = the built-in one `rollout.workflow` names."""
    python_workflow: str = ""
    """The name of a workflow given as an object: `rollout.workflow` resolves to "python:<it>"."""
    environment: Any = None
    """The environment given in Python (`train(environment=...)`, `GRPOTrainer(environment_factory=...)`): for
    `task=openenv` an OpenEnv `Environment` subclass or a TRL environment class (or a factory with no arguments), in
    place of `data.openenv.env`; for `task=verifiers` a verifiers `Environment` instance, in place of
    `data.verifiers.env_id`; None = the config's."""

    @classmethod
    def of(cls, cfg: Any, *, reward_fn: Callable | Sequence[Callable] | None = None,
           reward_weights: Sequence[float] | None = None, train_dataset: Any = None, eval_dataset: Any = None,
           task: Any = None, workflow: Any = None, workflow_kwargs: Mapping[str, Any] | None = None,
           environment: Any = None) -> "JobInputs":
        """The objects of a job whose config is `cfg` (resolved or not): the keywords of `train`, plus the
        config's import paths imported. Giving one thing both ways (e.g. `reward_fn=` and `reward.fn`, `task=`
        and `task: gsm8k`, `train_dataset=` and `data.path`, `workflow=` and `rollout.workflow=rlvr`) is a
        ValueError naming both."""
        fns, labels = _reward_fns(cfg, reward_fn)
        weights = _weights(cfg, reward_weights, len(fns))
        for obj, keyword, field in ((train_dataset, "train_dataset", "path"),
                                    (eval_dataset, "eval_dataset", "eval_path")):
            if obj is not None and getattr(cfg.data, field):
                raise ValueError(f"{keyword}= and data.{field}={getattr(cfg.data, field)!r} both name the rows: "
                                 "give one")
        custom, label, python_name = _task(cfg, task)
        flow, python_flow = _workflow(cfg, workflow, workflow_kwargs)
        if environment is not None and cfg.data.openenv.env:
            raise ValueError(f"environment= and data.openenv.env={cfg.data.openenv.env!r} both name the environment: "
                             "give one")
        if environment is not None and cfg.data.verifiers.env_id:
            raise ValueError(f"environment= and data.verifiers.env_id={cfg.data.verifiers.env_id!r} both name the "
                             "environment: give one")
        from rayllm_rl.environments.verifiers_env import is_verifiers_environment

        if environment is not None and not callable(environment) and not is_verifiers_environment(environment):
            raise ValueError(f"environment= is a {type(environment).__name__}: give the environment's class (or a "
                             "factory with no arguments), not an instance: every episode builds its own")
        return cls(fns, weights, labels, train_dataset, eval_dataset, custom, label, python_name, flow, python_flow,
                   environment)


def _reward_fns(cfg: Any, given) -> tuple[tuple[Callable, ...], tuple[str, ...]]:
    paths = list(cfg.reward.fn or [])
    if given is not None and paths:
        raise ValueError(f"reward_fn= and reward.fn={paths} both give the reward: give one")
    if given is None:
        fns = tuple(import_object(p, f"reward.fn[{i}]" if len(paths) > 1 else "reward.fn") for i, p in enumerate(paths))
        labels = tuple(f"reward.fn={p!r}" if len(paths) == 1 else f"reward.fn[{i}]={p!r}" for i, p in enumerate(paths))
    else:
        fns = tuple(given) if isinstance(given, (list, tuple)) else (given,)
        labels = tuple(f"reward_fn[{i}] ({getattr(f, '__name__', type(f).__name__)})" if len(fns) > 1 else
                       f"reward_fn ({getattr(f, '__name__', type(f).__name__)})" for i, f in enumerate(fns))
        if not fns:
            raise ValueError("reward_fn=[] gives no reward function")
    for fn, label in zip(fns, labels):
        if not callable(fn):
            raise ValueError(f"{label} is a {type(fn).__name__}, not a callable "
                             "fn(prompt, completion, prompt_ids, completion_ids, **columns)")
    return fns, labels


def _weights(cfg: Any, given, n: int) -> tuple[float, ...]:
    configured = list(cfg.reward.fn_weights or [])
    if given is not None and configured:
        raise ValueError(f"reward_weights= and reward.fn_weights={configured} both give the weights: give one")
    key = "reward_weights" if given is not None else "reward.fn_weights"
    weights = [float(w) for w in (given if given is not None else configured)]
    if weights and not n:
        raise ValueError(f"{key}={weights} weighs reward functions, but none is given (reward.fn or reward_fn=)")
    if weights and len(weights) != n:
        raise ValueError(f"{key}={weights} has {len(weights)} weights for {n} reward functions: give one per function")
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        raise ValueError(f"{key}={weights}: every weight must be a finite number")
    return tuple(weights)


def _task(cfg: Any, given) -> tuple[Any, str, str]:
    from rayllm_rl.envs.task import Task
    from rayllm_rl.envs.task_registry import PYTHON_TASK_PREFIX, is_custom

    name = cfg.task or ""
    if given is not None:
        if name and not name.startswith(PYTHON_TASK_PREFIX):
            raise ValueError(f"task= (a Python object) and task={name!r} in the config both name the task: give one")
        if not (isinstance(given, Task) or callable(given)):
            raise ValueError(f"task= is a {type(given).__name__}: expected a Task or a factory "
                             "factory(data_cfg, seed) -> Task")
        name = getattr(given, "name", None) or getattr(given, "__name__", None) or type(given).__name__
        return given, f"task= ({name})", str(name)
    if name.startswith(PYTHON_TASK_PREFIX):
        raise ValueError(f"task={name!r} names a task given as a Python object, and none was given (train(task=...))")
    if is_custom(name):
        factory = import_object(name, "task")
        if not callable(factory):
            raise ValueError(f"task={name!r} is a {type(factory).__name__}, not a factory "
                             "factory(data_cfg, seed) -> Task")
        return factory, f"task={name!r}", ""
    return None, "", ""


def _workflow(cfg: Any, given, given_kwargs: Mapping[str, Any] | None):
    """(the job's CustomWorkflow or None, the name `rollout.workflow` resolves to for one given in Python): the
    object of `workflow=`, or `rollout.workflow=package.module:Name` imported (naming the key when it does not
    import), with its keyword arguments (`workflow_kwargs=` or `rollout.workflow_kwargs`, command-line text
    converted to the parameters' types), checked against its signature (`CustomWorkflow.check`)."""
    from rayllm_rl.config import coerce
    from rayllm_rl.object_path import is_import_path
    from rayllm_rl.workflows.custom import PYTHON_WORKFLOW_PREFIX, CustomWorkflow, name_of, typed_kwargs

    name = cfg.rollout.workflow or "auto"
    configured = dict(cfg.rollout.workflow_kwargs or {})
    if given_kwargs is not None and configured:
        raise ValueError(f"workflow_kwargs= and rollout.workflow_kwargs={configured} both give the workflow's keyword "
                         "arguments: give one")
    if given_kwargs is not None and not isinstance(given_kwargs, Mapping):
        raise ValueError(f"workflow_kwargs= is a {type(given_kwargs).__name__}: expected a dict of keyword arguments")
    if given_kwargs is not None:
        kwargs, key = dict(given_kwargs), "workflow_kwargs="
    else:
        kwargs, key = configured, "rollout.workflow_kwargs"
    if given is not None:
        if name != "auto" and not name.startswith(PYTHON_WORKFLOW_PREFIX):
            raise ValueError(f"workflow= (a Python object) and rollout.workflow={name!r} both name the workflow: "
                             "give one")
        source, label, python_name = given, f"workflow= ({name_of(given)})", name_of(given)
    elif name.startswith(PYTHON_WORKFLOW_PREFIX):
        raise ValueError(f"rollout.workflow={name!r} names a workflow given as a Python object, and none was given "
                         "(train(workflow=...))")
    elif is_import_path(name):
        source, label, python_name = import_object(name, "rollout.workflow"), f"rollout.workflow={name!r}", ""
    else:
        if kwargs:
            raise ValueError(f"{key}={kwargs} are the keyword arguments of a workflow of your own (rollout.workflow="
                             f"package.module:Name, or train(workflow=...)); rollout.workflow={name!r} is not one (a "
                             "built-in workflow takes none)")
        return None, ""
    spec = CustomWorkflow(source, typed_kwargs(source, kwargs, coerce, key.rstrip("=")), label, key)
    spec.check()
    return spec, python_name
