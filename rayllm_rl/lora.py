"""LoRA policies (`model.lora.*`): one definition of the adapter that the learner trains, the engines
apply, checkpoints save and the export merges.

The adapter is injected into the HF model in place with peft (`inject_adapter_in_model`), so the
model keeps its class, config and parameter paths (plus `base_layer` and `lora_A`/`lora_B`
modules). What crosses between the roles is the adapter alone, named as peft saves it in
`adapter_model.safetensors` ("PEFT names": `base_model.model.<module path>.lora_A.weight`), which
is also what vLLM loads as a LoRA adapter. The base weights never move: every role loads them from
`model.path`.

Neutral ground: the learner, both engines and the job config import this module; it imports
torch, safetensors and peft only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator, Mapping

import torch

ADAPTER = "default"
"""peft's adapter name inside the model (it is dropped from PEFT names)."""
PEFT_PREFIX = "base_model.model."
"""What peft's saved keys put before the model's own module path."""
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama/Qwen-style decoders (what vLLM's LoRA layers cover)."""


@dataclasses.dataclass
class LoraOptions:
    """LoRA adapter of the policy (`model.lora.*`); rank 0 trains every weight (no adapter)."""

    rank: int = 0
    """Adapter rank r (0 = off: full-weight training). The learner trains only the adapter, only the
    adapter goes to the replicas, checkpoints are PEFT adapters; `python -m rayllm_rl.export_lora` merges."""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A (peft's lora_alpha; verl's default 16)."""
    dropout: float = 0.0
    """Dropout on the adapter's input in the training forward only (logprob recomputation runs without it)."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Module names (last path component) that get an adapter; default the attention and MLP projections."""

    def __post_init__(self) -> None:
        # the command line's `[a,b]` arrives as the items '[a' and 'b]' (rayllm_rl.config splits text on commas)
        if isinstance(self.target_modules, (list, tuple)):
            items = [n.strip().strip("[]").strip().strip("'\"") if isinstance(n, str) else n
                     for n in self.target_modules]
            self.target_modules = [n for n in items if n != ""]

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self, key: str = "model.lora") -> None:
        """Bad values fail naming the key."""
        if self.rank < 0:
            raise ValueError(f"{key}.rank={self.rank}: must be >= 0 (0 = no adapter)")
        if not self.enabled:
            return
        if not self.alpha > 0:
            raise ValueError(f"{key}.alpha={self.alpha}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{key}.dropout={self.dropout}: must be in [0, 1)")
        if not self.target_modules or not all(isinstance(n, str) and n for n in self.target_modules):
            raise ValueError(f"{key}.target_modules={self.target_modules!r}: give one or more module names, "
                             f"e.g. {list(DEFAULT_TARGETS)}")

    def peft_config(self, base_model_path: str = ""):
        """peft's LoraConfig of these options."""
        from peft import LoraConfig

        return LoraConfig(r=int(self.rank), lora_alpha=float(self.alpha), lora_dropout=float(self.dropout),
                          target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model_path or None)

    @classmethod
    def from_adapter_config(cls, directory: str | os.PathLike) -> "LoraOptions":
        """The options an `adapter_config.json` (a checkpoint's) was saved with."""
        path = Path(directory) / CONFIG_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: {directory} is not a PEFT LoRA adapter")
        cfg = json.loads(path.read_text())
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r}, only LORA adapters are supported")
        targets = cfg.get("target_modules") or []
        return cls(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0.0)),
                   target_modules=sorted(targets) if isinstance(targets, (list, set, tuple)) else [targets])


def inject(model: torch.nn.Module, opts: LoraOptions, base_model_path: str = "") -> torch.nn.Module:
    """Inject LoRA layers into `model` in place (peft; lora_A random, lora_B zero, so the output is the
    base model's until trained); only the adapter requires grad afterwards. Returns `model`."""
    from peft import inject_adapter_in_model

    opts.check()
    if not opts.enabled:
        raise ValueError("inject: model.lora.rank is 0 (no adapter)")
    try:
        inject_adapter_in_model(opts.peft_config(base_model_path), model, adapter_name=ADAPTER)
    except ValueError as exc:  # e.g. "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules={list(opts.target_modules)}: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return model


def is_adapter_name(name: str) -> bool:
    """Whether a parameter path of an injected model is the adapter's."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def peft_name(param_name: str) -> str:
    """A parameter path of the injected model -> its key in `adapter_model.safetensors`."""
    return PEFT_PREFIX + param_name.replace(f".{ADAPTER}.", ".")


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters by PEFT name, in `named_parameters()` order."""
    out = {peft_name(n): p for n, p in model.named_parameters() if is_adapter_name(n)}
    if not out:
        raise ValueError(f"{type(model).__name__} has no LoRA adapter (inject() was not called)")
    return out


def model_key(name: str) -> str:
    """A PEFT name -> the injected model's parameter path (inverse of `peft_name`)."""
    if not name.startswith(PEFT_PREFIX):
        raise KeyError(f"{name!r} is not a PEFT adapter name (they start with {PEFT_PREFIX!r})")
    path = name[len(PEFT_PREFIX):]
    for part in (".lora_A.", ".lora_B."):
        if part in path:
            return path.replace(part, f"{part}{ADAPTER}.", 1)
    raise KeyError(f"{name!r} is not a LoRA weight (lora_A / lora_B)")


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its base model: every LoRA layer skips its adapter inside the block.

    peft's `PeftModel.disable_adapter()` also sets `requires_grad=False` on the adapter's parameters
    and back, which an FSDP2-sharded model must not see (FSDP2 copies `requires_grad` to the unsharded
    parameter when it gathers); this sets only the flag the LoRA layers read in their forward."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"adapter_off: {type(model).__name__} has no LoRA layers")
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


def adapter_metas(model_path: str, opts: LoraOptions, dtype: str = "float32") -> list[tuple[str, tuple[int, ...], str]]:
    """`(PEFT name, shape, dtype)` of the adapter of `model_path`'s architecture, in send order, from the
    model built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inject(model, opts)
    return [(n, tuple(p.shape), str(dtype).removeprefix("torch.")) for n, p in adapter_parameters(model).items()]


# ---------------------------------------------------------------------------- PEFT-format files
def write_adapter(directory: str | os.PathLike, named: Mapping[str, torch.Tensor], opts: LoraOptions,
                  base_model_path: str = "") -> str:
    """Write `named` (PEFT names) as a PEFT adapter: `adapter_model.safetensors` + `adapter_config.json`,
    loadable by `PeftModel.from_pretrained(base, directory)` and by vLLM's `LoRARequest`. Returns the dir."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bad = [n for n in named if not n.startswith(PEFT_PREFIX)]
    if bad:
        raise KeyError(f"write_adapter: {bad[:3]} are not PEFT adapter names")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in named.items()}, str(directory / WEIGHTS_FILE))
    opts.peft_config(base_model_path).save_pretrained(str(directory))
    return str(directory)


def read_adapter(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter directory, by PEFT name."""
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {directory} is not a PEFT adapter "
                                "(saved with model.lora.rank > 0?)")
    return load_file(str(path))


def export_merged(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, base_model_path: str = "",
                  dtype: torch.dtype = torch.float32) -> str:
    """Merge a PEFT adapter into its base model and save a full HF model (`from_pretrained(out_dir)`).

    `base_model_path`: the base model; empty = the adapter config's `base_model_name_or_path`. The
    adapter directory's tokenizer files, if any, are copied too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = Path(adapter_dir)
    LoraOptions.from_adapter_config(adapter_dir)  # a clear error if it is not a LoRA adapter
    base = base_model_path or json.loads((adapter_dir / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter_dir / CONFIG_FILE} names no base model: pass base_model_path")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    tok_source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else Path(base)
    if (tok_source / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(str(tok_source)).save_pretrained(str(out_dir))
    return str(out_dir)


def engine_tensors(model: torch.nn.Module, opts: LoraOptions, base_model_path: str = ""):
    """An inference engine's LoRA policy: inject the adapter into `model` (on its device, in its dtype) and
    return `(adapter parameters by PEFT name, base parameters by path)`: what updates swap, and what
    stays as loaded."""
    inject(model, opts, base_model_path)
    first = next(model.parameters())
    model.to(device=first.device, dtype=first.dtype)  # the new lora_A/lora_B follow the base weights
    model.eval().requires_grad_(False)  # the new modules (dropout) start in training mode
    adapter = adapter_parameters(model)
    frozen = {n: p for n, p in model.named_parameters() if not is_adapter_name(n)}
    return adapter, frozen
