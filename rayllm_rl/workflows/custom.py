"""A rollout workflow of your own (`rollout.workflow=package.module:Name`, `train(workflow=...)`): AReaL's contract.

The user gives a class or a factory; every env worker (and the local backend's process) calls it once with the
keywords of `JOB_KEYWORDS` its signature takes, plus the user's `workflow_kwargs`, and gets an object with
`async arun_episode(engine, data) -> TensorDict`: the trajectories of one dataset row (a GRPO group, or one
trajectory). An instance given in Python is used as it is. `CustomWorkflow.check` reads the signature on the
driver, before any actor starts, so a keyword it cannot take fails there, naming the key.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

PYTHON_WORKFLOW_PREFIX = "python:"
"""The resolved `rollout.workflow` of a workflow given as a Python object (`train(workflow=...)`): "python:<name>"."""

JOB_KEYWORDS: Mapping[str, str] = {
    "reward_fn": "the task's reward (reward.model / reward.judge folded in), AReaL's signature "
                 "reward_fn(prompt, completion, prompt_ids, completion_ids, **row) -> float | {'reward': float, ...}",
    "tokenizer": "the policy's HF tokenizer, loaded in the worker from model.path",
    "sampling": "rayllm_rl.inference.protocol.SamplingParams of rollout.* (max_new_tokens, temperature, top_p, "
                "top_k): the learner scores every token at these",
    "group_size": "rollout.group_size (int): trajectories per prompt, GRPO's group",
    "max_turns": "rollout.max_turns (int)",
    "turn_discount": "rollout.turn_discount (float)",
    "sample_timeout_s": "rollout.sample_timeout_s (float or None): one sample's bound, for a workflow whose samples "
                        "run independently (e.g. through GroupedWorkflow(timeout_s=...))",
    "task": "the job's Task without its rows (Task.worker_part: name, reward_fn, sft_target, env_cls)",
    "config": "the job's validated GRPOJobConfig",
}
"""What the job passes a workflow's class or factory: each keyword its signature names (all of them to `**kwargs`)."""


def kind_of(source: Any) -> str:
    """'class', 'instance' (an object with `arun_episode`, used as is), 'factory' (any other callable) or 'other'."""
    if inspect.isclass(source):
        return "class"
    if hasattr(source, "arun_episode"):
        return "instance"
    return "factory" if callable(source) else "other"


def name_of(source: Any) -> str:
    return getattr(source, "__name__", None) or type(source).__name__


def has_async_arun_episode(obj: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, "arun_episode", None))


@dataclasses.dataclass(frozen=True)
class CustomWorkflow:
    """The user's workflow as the job holds it: `source` (a class, a factory or an instance), the keywords of
    `workflow_kwargs`, and how errors name it. Picklable: it rides in the env workers' constructor arguments
    (a class from an importable module by reference, one defined in a script or notebook by value)."""

    source: Any
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str = ""
    """How errors name it: "rollout.workflow='m:C'" or "workflow= (C)"."""
    kwargs_key: str = "rollout.workflow_kwargs"
    """Where `kwargs` came from, for errors: "rollout.workflow_kwargs" or "workflow_kwargs="."""

    @property
    def name(self) -> str:
        return name_of(self.source)

    def parameters(self) -> tuple[dict[str, inspect.Parameter], bool]:
        """(the named parameters of the class's constructor or the factory, whether it takes **kwargs); an
        instance takes none; a signature Python cannot read takes every keyword."""
        if kind_of(self.source) == "instance":
            return {}, False
        try:
            params = inspect.signature(self.source).parameters
        except (TypeError, ValueError):
            return {}, True
        named = {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        return named, any(p.kind is p.VAR_KEYWORD for p in params.values())

    def takes(self, keyword: str) -> bool:
        """Whether building it passes `keyword` (its signature names it, or has **kwargs)."""
        named, var_kw = self.parameters()
        return var_kw or (keyword in named and named[keyword].kind is not inspect.Parameter.POSITIONAL_ONLY)

    def check(self) -> None:
        """ValueError / TypeError naming `label` unless the job can build it: a class whose `arun_episode` is
        `async def`, a factory, or an instance with an async `arun_episode` (and no kwargs); every parameter
        without a default is a job keyword or in the kwargs; every kwarg is a parameter and no job keyword."""
        kind, label = kind_of(self.source), self.label or self.name
        contract = "async def arun_episode(self, engine, data) -> TensorDict"
        if kind == "other":
            raise TypeError(f"{label} is a {type(self.source).__name__}: expected a class or factory returning a "
                            f"workflow (an object with {contract}), or such an object")
        if kind in ("class", "instance") and not has_async_arun_episode(self.source):
            raise TypeError(f"{label}: {self.name} has no {contract} (AReaL's rollout contract)")
        if kind == "instance":
            if self.kwargs:
                raise ValueError(f"{self.kwargs_key}={dict(self.kwargs)} goes with a class or factory; {label} is an "
                                 "instance, used as it is")
            return
        named, var_kw = self.parameters()
        clash = sorted(set(self.kwargs) & set(JOB_KEYWORDS))
        if clash:
            raise ValueError(f"{self.kwargs_key} sets {clash}, which the job passes {label} itself "
                             f"({'; '.join(f'{k}: {JOB_KEYWORDS[k]}' for k in clash)}); set the job's keys instead")
        unknown = sorted(k for k in self.kwargs if not var_kw and k not in named)
        if unknown:
            raise ValueError(f"{self.kwargs_key} sets {unknown}, which {label} does not take (its parameters: "
                             f"{sorted(named)})")
        given = set(JOB_KEYWORDS) | set(self.kwargs)
        for pname, p in named.items():
            required = p.default is inspect.Parameter.empty
            if required and (p.kind is p.POSITIONAL_ONLY or pname not in given):
                raise ValueError(f"{label}: its parameter {pname!r} has no default and is none of the keywords the job "
                                 f"passes ({', '.join(JOB_KEYWORDS)}); give it a default "
                                 f"or set it in {self.kwargs_key}")

    def build(self, offered: Mapping[str, Any]) -> Any:
        """The workflow: the instance itself, or the class / factory called with the `offered` job keywords it
        takes and the kwargs; TypeError naming `label` if what a factory returns has no async `arun_episode`."""
        if kind_of(self.source) == "instance":
            return self.source
        made = self.source(**{k: v for k, v in offered.items() if self.takes(k)}, **self.kwargs)
        if not has_async_arun_episode(made):
            raise TypeError(f"{self.label or self.name} returned a {type(made).__name__}, which has no "
                            "async def arun_episode(self, engine, data) -> TensorDict")
        return made


def typed_kwargs(source: Any, kwargs: Mapping[str, Any], convert: Callable[[Any, type, str], Any],
                 key: str) -> dict[str, Any]:
    """`kwargs` with each text value (the command line gives text) converted by `convert(value, type, key)` to the
    type of its parameter's default or annotation when that is bool, int or float; other values as given."""
    named, _ = CustomWorkflow(source).parameters()
    simple = {"bool": bool, "int": int, "float": float, bool: bool, int: int, float: float}
    out = dict(kwargs)
    for name, value in kwargs.items():
        p = named.get(name)
        if not isinstance(value, str) or p is None:
            continue
        tp = type(p.default) if type(p.default) in (bool, int, float) else simple.get(p.annotation)
        if tp is not None:
            out[name] = convert(value, tp, f"{key}.{name}")
    return out
