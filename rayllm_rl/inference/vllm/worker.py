"""The vLLM side of weight sync: code that runs inside vLLM's worker process, not in the actor.

vLLM keeps its weights in a worker process it spawns itself, fused and possibly sharded
(`qkv_proj`, `gate_up_proj`). Our transports cannot reach them from the replica actor, so the
receiving end of a weight update lives here:

* :class:`RayllmWeightTransfer` is a vLLM weight-transfer backend (registered as ``"rayllm"``
  when vLLM imports this module as the worker extension). It builds this worker's receiving end
  through the transport registry (its rank is the replica's first rank plus its tensor-parallel
  rank: a group transport, or CUDA IPC, whose plain-data handoff the actor passes in
  ``rayllm_begin_receive``) or, where the receiver needs Ray (the object store), maps the staging
  segment the replica actor fills (:mod:`rayllm_rl.inference.vllm.staging`). It loads what arrives
  through ``model.load_weights``, which takes HF names and fuses them.
* :class:`RayllmWorkerExtension` (vLLM's ``worker_extension_cls``) adds the calls the actor
  makes through ``collective_rpc``: start receiving in a background thread while the engine
  keeps generating, ask whether the bytes are in, and a weight checksum.

One update, driven by :class:`~rayllm_rl.inference.vllm.engine.VLLMEngine`:
``rayllm_begin_receive`` (bytes move while decoding goes on) → poll ``rayllm_receive_state``
→ the engine core's ``pause_scheduler_async(mode="keep", clear_cache=True)`` → ``start_weight_update`` →
``update_weights({"version": v})`` (here: ``model.load_weights`` from the received buffers)
→ ``finish_weight_update(str(v))`` → ``resume_generation``. Kept requests are re-prefilled
with the new weights, so every token stamped v was sampled from policy v.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rayllm_rl.inference.protocol import weights_checksum
from rayllm_rl.inference.vllm.shadow import ShadowModel, retie_lm_head
from rayllm_rl.weight_sync import metas_from_spec
from rayllm_rl.weight_sync.ends import ReceiverEnd
from rayllm_rl.weight_sync.registry import SyncSpec, build_receiver

BACKEND = "rayllm"


@dataclasses.dataclass
class RayllmInitInfo(WeightTransferInitInfo):
    """One of: `spec`, a :class:`~rayllm_rl.weight_sync.registry.SyncSpec` as a dict (this worker
    joins the transport itself), or `staging`, `{"segment", "metas", "timeout_s"}` (the replica actor
    receives and stages the bytes for this worker)."""

    spec: dict | None = None
    staging: dict | None = None
    double_buffer: bool = False
    """Load updates into a shadow copy of the model while the live one generates, and swap between
    steps (vllm/shadow.py); honoured on CPU only (on GPUs CUDA graphs hold the parameters' addresses)."""


@dataclasses.dataclass
class RayllmUpdateInfo(WeightTransferUpdateInfo):
    """Apply the update received by ``rayllm_begin_receive``, stamped `version`."""

    version: int


class _LoadTarget:
    """What our receivers hand tensors to: `model.load_weights` (a copy into vLLM's fused params), or
    a :class:`~rayllm_rl.inference.vllm.shadow.ShadowModel`'s load (the back copy, while the live one generates)."""

    copies_on_swap = True
    """`swap_weights` copies what it is handed into vLLM's parameters (vLLM's layerwise reload may hold a
    layer's tensors until `finish_weight_update`; `_load` keeps no device tensor after), so a CUDA IPC
    receiver hands it the learner's tensors themselves: one device copy, no second buffer."""

    def __init__(self, model: torch.nn.Module, metas, device: torch.device | None = None, shadow=None):
        self.model = model
        self.metas = metas
        self.device = device
        """The worker's device (a receiver that opens memory on it, CUDA IPC, needs its index)."""
        self.shadow = shadow

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Names, shapes and dtypes an update may carry (meta tensors: no memory of their own)."""
        return {m.name: torch.empty(m.shape, dtype=m.dtype, device="meta") for m in self.metas}

    def swap_weights(self, named: dict[str, torch.Tensor], version: int) -> float:
        """Copy the received tensors into vLLM's parameters (names were checked against the
        checkpoint when the group was joined); returns the seconds it took."""
        t0 = time.perf_counter()
        _load(self.model, named, shadow=self.shadow)
        return time.perf_counter() - t0


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers with nothing to load by design:
    rotary embeddings (no checkpoint tensors) and a tied lm_head (re-tied by `retie_lm_head`).
    Any other layer that fails to load still warns."""

    def __init__(self, tied: bool):
        super().__init__()
        self.quiet = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied else set())

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not ("Failed to load weights" in str(record.msg) and args and args[0] in self.quiet)


# What this worker process last loaded: the tensors (a transport's host buffer, which keeps these
# values until the next update starts) or just their checksum.
_LAST_LOADED: dict[str, Any] = {}


def _load(model: torch.nn.Module, named: dict[str, torch.Tensor], *, keep: bool = True, shadow=None) -> None:
    """`model.load_weights` (HF names in, vLLM fuses and repacks them), or `shadow.load` (the back copy,
    loaded and processed in full; the live model is untouched until the swap), and remember what was loaded.

    vLLM's CPU kernels repack linear weights into storage that `named_parameters()` no longer
    shows, so a checksum is taken of the tensors handed to vLLM, not read back from it; it is
    computed when asked for, not inside the paused update. `keep=False` (tensors that would
    otherwise be freed), or any tensor on a device, stores the checksum right away instead: device
    memory is never held between updates (it may be the learner's, lent through CUDA IPC, which
    offloads right after the hand-over, or a buffer that takes room from the KV cache)."""
    if shadow is not None:
        shadow.load(named.items())
    else:
        with torch.no_grad():
            model.load_weights(list(named.items()))
    keep = keep and all(t.device.type == "cpu" for t in named.values())
    _LAST_LOADED.clear()
    _LAST_LOADED.update({"named": named} if keep else {"checksum": weights_checksum(named)})


class RayllmWeightTransfer(WeightTransferEngine[RayllmInitInfo, RayllmUpdateInfo]):
    """vLLM weight-transfer backend over rayllm_rl's transports; every wait is bounded."""

    init_info_cls = RayllmInitInfo
    update_info_cls = RayllmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: Any = None
        self.timeout_s = 120.0
        self._thread: threading.Thread | None = None
        self._received: int | None = None
        self._error: BaseException | None = None
        self.receive_s = 0.0
        self.shadow = None
        """The back copy of the model (double-buffered updates), built once and kept across re-inits."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedReloadWarnings(tied))

    def init_transfer_engine(self, init_info: RayllmInitInfo) -> None:
        self.shutdown()
        if init_info.double_buffer and self.device.type == "cpu" and self.shadow is None:
            self.shadow = ShadowModel(self.model, self.vllm_config, self.device)
        elif not init_info.double_buffer:
            self.shadow = None
        if init_info.staging is not None:
            from rayllm_rl.inference.vllm.staging import StagingReader

            staging = init_info.staging
            self.timeout_s = float(staging["timeout_s"])
            self.receiver = _StagedReceiver(self._target(staging["metas"]),
                                            StagingReader(staging["segment"], metas_from_spec(staging["metas"])))
            return
        spec = SyncSpec.from_dict(init_info.spec)
        self.timeout_s = spec.timeout_s
        rank = spec.rank + _tensor_parallel_rank()  # each worker of a replica is a rank of its own
        self.receiver = build_receiver(spec.for_rank(rank), self._target(spec.metas))

    def _target(self, metas) -> _LoadTarget:
        return _LoadTarget(self.model, metas_from_spec(metas), self.device, self.shadow)

    # ------------------------------------------------------------------ receive while generating
    def begin_receive(self, header_timeout_s: float, handoff: Any = None) -> None:
        """Start receiving the next update on a background thread (the engine keeps stepping).
        `handoff`: the version the replica actor staged (nothing to wait for), a pull transport's
        plain-data handoff (CUDA IPC handles, opened here), or None (the bytes come in a group)."""
        if self.receiver is None:
            raise RuntimeError("rayllm weight transfer: init_weight_transfer_engine was not called")
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("rayllm weight transfer: a receive is already running")
        self._received, self._error = None, None

        def run():
            t0 = time.perf_counter()
            try:
                version = self.receiver.receive(handoff, header_timeout_s=header_timeout_s)
                if self.shadow is not None:  # load and process it now, into the back copy
                    self.receiver.swap(version)
                self._received = version
            except BaseException as exc:  # reported to the actor by receive_state / receive_weights
                self._error = exc
            self.receive_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="rayllm-weight-receive", daemon=True)
        self._thread.start()

    def receive_state(self) -> dict[str, Any]:
        """`{"done": bool, "version": int | None, "error": str | None, "receive_s": float, "shadow_loaded": bool}`;
        `shadow_loaded`: the update sits processed in the shadow model, so `swap_shadow` is all that is left."""
        done = self._thread is None or not self._thread.is_alive()
        err = None if self._error is None else f"{type(self._error).__name__}: {self._error}"
        return {"done": done, "version": self._received, "error": err, "receive_s": self.receive_s,
                "shadow_loaded": done and self.shadow is not None and self._received is not None}

    # ------------------------------------------------------------------ vLLM's update lifecycle
    def start_weight_update(self) -> None:
        """Layerwise reload: vLLM restores each layer's loadable parameters (a platform may have
        repacked them after the first load), so checkpoint-format tensors load as at start-up.
        Double-buffered: nothing, the update was loaded and processed in the shadow already."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.shadow is None:
            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Re-process the loaded layers (fusing, repacking) exactly as after the first load."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.shadow is None:
            finalize_layerwise_reload(self.model, self.model_config)
            retie_lm_head(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def swap_shadow(self, version: int) -> None:
        """Make the update loaded into the shadow live (generation paused); vLLM's update lifecycle, which
        reloads the live model, is not needed around it."""
        self.receive_weights(RayllmUpdateInfo(version=int(version)))

    def receive_weights(self, update_info: RayllmUpdateInfo) -> None:
        """Load the received update (called while generation is paused)."""
        if self._thread is None:
            raise RuntimeError("rayllm weight transfer: update_weights without a prior rayllm_begin_receive")
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"rayllm weight transfer: the receive did not finish within {self.timeout_s:g}s")
        self._thread = None
        if self._error is not None:
            raise RuntimeError(f"rayllm weight transfer: receiving failed: {self._error}") from self._error
        if self.shadow is not None:
            if self._received != int(update_info.version):
                raise RuntimeError(f"rayllm weight transfer: version {update_info.version} asked, the shadow "
                                   f"holds {self._received}")
            self.shadow.swap_into()  # the processed update becomes live; the shadow keeps the old weights
        else:
            self.receiver.swap(int(update_info.version))

    def shutdown(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()


def _tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class _StagedReceiver(ReceiverEnd):
    """The receiving end over the replica's staging segment: the handoff is the staged version."""

    last_stats = None

    def __init__(self, target: _LoadTarget, reader):
        self.target, self.reader = target, reader
        self._version: int | None = None

    def receive(self, handoff: int, *, header_timeout_s: float | None = None) -> int:
        self._version = int(handoff)
        return self._version

    def swap(self, version: int | None = None) -> float:
        if self._version is None:
            raise RuntimeError("staged weights: nothing staged since the last update")
        self._version = None
        return self.target.swap_weights(self.reader.views(), version)

    def close(self) -> None:
        self._version = None


class RayllmWorkerExtension:
    """Methods added to vLLM's worker (``worker_extension_cls``), called through ``collective_rpc``."""

    def _rayllm(self) -> RayllmWeightTransfer:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, RayllmWeightTransfer):
            raise RuntimeError(f"vLLM was not started with weight_transfer_config backend '{BACKEND}'")
        return engine

    def rayllm_begin_receive(self, header_timeout_s: float, handoff: Any = None) -> None:
        """`handoff` came through vLLM's RPC (msgpack): plain data only (ints, strings, bytes, lists, dicts)."""
        self._rayllm().begin_receive(header_timeout_s, handoff)

    def rayllm_receive_state(self) -> dict[str, Any]:
        return self._rayllm().receive_state()

    def rayllm_swap_shadow(self, version: int) -> None:
        self._rayllm().swap_shadow(version)

    def rayllm_load_named(self, blob: bytes) -> None:
        """Direct load of tensors sent inside the RPC as safetensors bytes (vLLM's RPC encoding
        does not keep tensors nested in lists), during a paused update."""
        from safetensors.torch import load

        engine = getattr(self, "weight_transfer_engine", None)
        shadow = getattr(engine, "shadow", None)
        _load(self.model_runner.get_model(), load(blob), keep=False, shadow=shadow)
        if shadow is not None:
            shadow.swap_into()

    def rayllm_loaded_checksum(self) -> float | None:
        """Checksum of the last weights loaded into this worker (None: still the checkpoint's).
        Ask between updates: a transport's buffer is rewritten once the next receive begins."""
        if "named" in _LAST_LOADED:
            _LAST_LOADED["checksum"] = weights_checksum(_LAST_LOADED.pop("named"))
        return _LAST_LOADED.get("checksum")


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, RayllmWeightTransfer)
