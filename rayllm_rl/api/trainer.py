"""`GRPOTrainer`: TRL's front door (`GRPOTrainer(model, reward_funcs, train_dataset, ...).train()`) over `train`.

It only translates: `model` is `model.path`, `reward_funcs` / `reward_weights` / the datasets / `callbacks` /
`workflow` (AReaL's custom rollout workflow, with `workflow_kwargs`) are `train`'s objects, `args` the job config
(a GRPOJobConfig, a dict of keys, or a list of `key=value` overrides). What runs, and every check before any actor
starts, is `train`'s.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from rayllm_rl.job.config import GRPOJobConfig


class GRPOTrainer:
    """`GRPOTrainer(model=None, reward_funcs=None, train_dataset=None, eval_dataset=None, args=None,
    reward_weights=None, callbacks=None, workflow=None, workflow_kwargs=None, environment_factory=None).train() ->
    summary`: the job
    `train(config, reward_fn=..., ...)` runs."""

    def __init__(self, model: str | None = None,
                 reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None,
                 args: GRPOJobConfig | Mapping[str, Any] | Sequence[str] | None = None,
                 reward_weights: Sequence[float] | None = None, callbacks: Sequence[Any] | None = None,
                 workflow: Any = None, workflow_kwargs: Mapping[str, Any] | None = None,
                 environment_factory: Any = None) -> None:
        config = config_of(args)
        if model is not None:
            if not isinstance(model, str):
                raise TypeError(f"model is a {type(model).__name__}: pass the model's local directory or hub id (every "
                                "role loads it with from_pretrained)")
            if config.model.path and config.model.path != model:
                raise ValueError(f"model={model!r} and args' model.path={config.model.path!r} both name the model: "
                                 "give one")
            from rayllm_rl.config import apply_dict

            config = apply_dict(config, {"model": {"path": model}})
        self.config = config
        """The job config as given (unresolved: the task's presets fill it when `train` validates it)."""
        self.reward_funcs, self.reward_weights = reward_funcs, reward_weights
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.callbacks = callbacks
        """Callback objects (callbacks.py), as TRL's `callbacks`."""
        self.workflow, self.workflow_kwargs = workflow, workflow_kwargs
        """A rollout workflow of your own (`train(workflow=...)`, docs/extending.md) and its keyword arguments."""
        self.environment_factory = environment_factory
        """TRL's `environment_factory` (a class with `reset(**row)` and tool methods; `reward_funcs` then get
        `environments=`), or an OpenEnv Environment subclass: `train(environment=...)`, task=openenv."""

    def train(self) -> dict:
        """Run the job (`rayllm_rl.train`); returns its summary."""
        from rayllm_rl.api.entry import train

        return train(self.config, callbacks=self.callbacks, reward_fn=self.reward_funcs,
                     reward_weights=self.reward_weights, train_dataset=self.train_dataset,
                     eval_dataset=self.eval_dataset, workflow=self.workflow, workflow_kwargs=self.workflow_kwargs,
                     environment=self.environment_factory)


def config_of(args: GRPOJobConfig | Mapping[str, Any] | Sequence[str] | None) -> GRPOJobConfig:
    """The job config `args` stands for: itself, a dict of nested sections or dotted keys
    ({"trainer": {"steps": 5}} or {"trainer.steps": 5}) over the defaults, or `key=value` overrides."""
    from rayllm_rl.config import apply_dict, parse_overrides

    if args is None:
        return GRPOJobConfig()
    if isinstance(args, GRPOJobConfig):
        return args
    if isinstance(args, Mapping):
        nested: dict[str, Any] = {}
        for key, value in args.items():
            *path, last = str(key).split(".")
            node = nested
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return apply_dict(GRPOJobConfig(), nested)
    if isinstance(args, Sequence) and not isinstance(args, str):
        return apply_dict(GRPOJobConfig(), parse_overrides(list(args)))
    raise TypeError(f"args is a {type(args).__name__}: expected a GRPOJobConfig, a dict of config keys or a list of "
                    "'key=value' overrides")
