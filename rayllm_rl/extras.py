"""The optional features and the pip extra each needs. The core install (torch, transformers, ray[default],
tensordict, datasets, and the packages they bring that our code imports) runs the built-in arithmetic and prompt
tasks with the Transformers engine; a config that uses a feature whose package is missing fails at `validate()`,
naming the extra: `pip install 'rayllm_rl[lora]'`."""
from __future__ import annotations

import importlib.util
from typing import Any

EXTRAS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "trackers": ("tensorboard", "wandb", "mlflow", "matplotlib"),
    "mcp": ("mcp",),
    "gguf": ("gguf", "accelerate"),
    "reasoning-gym": ("reasoning_gym",),
    "math": ("math_verify", "latex2sympy2_extended"),
    "lora": ("peft",),
    "agents": ("openai",),
    "tinker": ("tinker", "uvicorn", "starlette", "zstandard"),
    "openenv": ("openenv",),
    "verifiers": ("verifiers",),
}
"""Each extra and the modules it installs (pyproject.toml's optional-dependencies; `[all]` is every one but vllm and
openenv and verifiers, whose fastmcp / verifiers 0.3.1 need mcp<2 where the `mcp` extra pins 2.3:
docs/environments.md)."""

NOT_IN_ALL = frozenset({"vllm", "openenv", "verifiers"})
"""Extras `[all]` leaves out: vllm (a CPU build `make` installs, a CUDA one on GPUs), openenv and verifiers (openenv's
fastmcp and verifiers 0.3.1 need mcp<2, the `mcp` extra pins 2.3: installed in a venv of their own)."""

TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""trackers.loggers names and the module each needs (jsonl needs none)."""


class MissingExtraError(ImportError):
    """A feature the config asks for needs a package this environment lacks; the message names the extra."""


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(feature: str, extra: str, modules: tuple[str, ...] = ()) -> None:
    """MissingExtraError naming `feature` and `pip install 'rayllm_rl[extra]'` when one of `modules` (default: all
    of `extra`'s; e.g. only wandb of the trackers) is missing."""
    missing = [m for m in modules or EXTRAS[extra] if not installed(m)]
    if missing:
        also = "" if extra in NOT_IN_ALL else " (or rayllm_rl[all])"
        raise MissingExtraError(f"{feature} needs {', '.join(missing)}, which this environment lacks: "
                                f"pip install 'rayllm_rl[{extra}]'{also}")


def check_extras(cfg: Any) -> None:
    """Every optional feature a resolved job config uses has its packages here (the job's own machine)."""
    for name in cfg.trackers.loggers:
        if name in TRACKER_MODULES:
            require(f"trackers.loggers={name}", "trackers", (TRACKER_MODULES[name],))
    if cfg.task == "reasoning_gym":
        require("task=reasoning_gym", "reasoning-gym")
    if cfg.task == "math":
        require("task=math (its answer checker)", "math")
    if cfg.model.lora.enabled:
        require("model.lora.enabled=true", "lora")
    from rayllm_rl.hub import names_gguf

    if names_gguf(str(cfg.model.path), cfg.model.gguf_file):
        require(f"model.path={cfg.model.path} (a GGUF file, dequantized by transformers)", "gguf")
    if cfg.task == "openenv" and cfg.data.openenv.base_url:
        require("data.openenv.base_url (OpenEnv's client)", "openenv")
    if cfg.task == "verifiers":
        require("task=verifiers", "verifiers")
    if cfg.rollout.workflow == "openai_agent":
        require("rollout.workflow=openai_agent (agents written with the OpenAI SDK)", "agents")
