"""A second copy of vLLM's model inside its worker: the back buffer of a weight update (CPU).

vLLM loads an update into its live parameters and then re-processes them (on CPU: oneDNN repacks
every linear layer), so generation must be paused for the whole load: ~70 ms for 101.5 MB here,
most of the update's stall. With a shadow model the worker loads and re-processes the update into
the shadow on a background thread while the live model keeps generating; between two engine steps
:meth:`ShadowModel.swap_into` exchanges the two models' weight state, module by module (parameters,
buffers and the kernels processing made, e.g. ``cpu_linear``), a pointer swap of well under a
millisecond. The previous version then sits in the shadow, which the next update reloads.

Only where no one holds the parameters' addresses: CPU (vLLM's CPU build runs eagerly here).
On GPUs CUDA graphs keep the addresses, so the live load (a device copy) stays; see
docs/inference-engines.md. Costs one more copy of the weights (and of CPU kernels' packed weights) in
the worker's memory.
"""
from __future__ import annotations

import copy
import threading
from typing import Iterable

import torch

_KEEP = frozenset({"_modules", "training"})
"""Module attributes a swap never exchanges: the children (swapped one by one) and the mode."""


def _is_hook_dict(key: str) -> bool:
    return "hooks" in key or key.startswith(("_state_dict", "_load_state_dict"))


class ShadowModel:
    """The worker's back copy of `live`: built like it, loaded in the background, swapped in."""

    def __init__(self, live: torch.nn.Module, vllm_config, device: torch.device):
        self.live = live
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.model = self._build()
        self.loaded = False
        """Whether the shadow has had its first full load and processing (before it, nothing to swap)."""
        self._registered = {id(m) for m in vllm_config.compilation_config.static_forward_context.values()}
        """Live modules vLLM's forward context points at (attention layers: KV cache bound to them): never swapped."""
        self.lock = threading.Lock()
        """Held while the shadow loads or swaps (a background load and a swap never overlap)."""

    def _build(self) -> torch.nn.Module:
        """A model of the live one's architecture, config and sharding (this worker's TP rank), whose
        attention layers register in a forward context of its own (vLLM refuses a layer name twice) and
        which shares no module with the live one: vLLM caches rotary embeddings across models, and a
        reload of the shadow puts each of its modules on the meta device for a moment."""
        from vllm.model_executor.layers import rotary_embedding
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        cfg = copy.copy(self.vllm_config)
        compilation = copy.copy(cfg.compilation_config)
        compilation.static_forward_context = {}
        if hasattr(compilation, "static_all_moe_layers"):
            compilation.static_all_moe_layers = []
        object.__setattr__(cfg, "compilation_config", compilation)
        cached = dict(rotary_embedding._ROPE_DICT)
        rotary_embedding._ROPE_DICT.clear()
        try:
            with set_default_torch_dtype(cfg.model_config.dtype), self.device:
                model = initialize_model(vllm_config=cfg)
        finally:
            rotary_embedding._ROPE_DICT.clear()
            rotary_embedding._ROPE_DICT.update(cached)
        live = {id(m): name for name, m in self.live.named_modules(remove_duplicate=False)}
        shared = sorted({live[id(m)] for m in model.modules() if id(m) in live})
        if shared:
            raise RuntimeError(f"shadow model: modules shared with the live model (a reload would touch them while "
                               f"it generates): {shared[:5]}; set inference.options.double_buffer_weights=false "
                               "to load updates in place")
        return model.eval()

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load an update (HF names, checkpoint layout) into the shadow and process it as vLLM does
        at start-up (first time) or through its layerwise reload (after). The live model is untouched."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model_config = self.vllm_config.model_config
        with self.lock, torch.no_grad(), set_current_vllm_config(self.vllm_config):
            if not self.loaded:
                self.model.load_weights(list(named))
                process_weights_after_loading(self.model, model_config, self.device)
            else:
                initialize_layerwise_reload(self.model)
                self.model.load_weights(list(named))
                finalize_layerwise_reload(self.model, model_config)
            retie_lm_head(self.model)  # a tied head the update does not carry: point it at the new embedding
            self.loaded = True

    def swap_into(self) -> int:
        """Exchange the weight state of every live module with its shadow twin (between engine steps);
        returns how many modules were swapped. Afterwards the shadow holds the previous weights."""
        if not self.loaded:
            raise RuntimeError("shadow model: swap before any update was loaded into it")
        swapped = 0
        with self.lock:
            pairs = zip(self.live.named_modules(), self.model.named_modules())
            for (name, live), (shadow_name, shadow) in pairs:
                if name != shadow_name or type(live) is not type(shadow):
                    raise RuntimeError(f"shadow model: module {shadow_name!r} ({type(shadow).__name__}) does not "
                                       f"mirror live module {name!r} ({type(live).__name__})")
                if id(live) in self._registered or not (live._parameters or live._buffers or shadow._parameters):
                    continue
                keys = (set(live.__dict__) | set(shadow.__dict__)) - _KEEP
                for key in [k for k in keys if not _is_hook_dict(k)]:
                    a, b = live.__dict__.get(key, _MISSING), shadow.__dict__.get(key, _MISSING)
                    if getattr(a, "__self__", None) is live and getattr(b, "__self__", None) is shadow:
                        continue  # a method bound to its own module (CustomOp's `_forward_method`): stays
                    _set(live, key, b)
                    _set(shadow, key, a)
                swapped += 1
        return swapped


_MISSING = object()


def retie_lm_head(model: torch.nn.Module) -> None:
    """Point a tied lm_head at the freshly loaded embedding again and re-process it.

    With tied embeddings the checkpoint has no `lm_head.weight`, so vLLM's layerwise reload
    finds nothing to load for the head and puts its old kernel tensors back: the head would
    keep scoring with the previous policy's embedding (seen on CPU, where the head holds a
    repacked copy). Re-tying and re-running the head's post-load processing fixes both.
    """
    config = getattr(model, "config", None)
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _set(module: torch.nn.Module, key: str, value) -> None:
    if value is _MISSING:
        module.__dict__.pop(key, None)
    else:
        module.__dict__[key] = value
