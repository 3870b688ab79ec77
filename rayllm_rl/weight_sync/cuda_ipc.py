"""Weights handed over on one GPU through CUDA IPC (the colocated placement: learner rank 0 and its replica
share the device), with no trip through host memory.

Sender (:class:`CudaIpcSender`, learner rank 0): ``send(named, v)`` exports a CUDA IPC handle of each of
the learner's own tensors (torch's ``reduce_tensor``: no copy) and returns them as a handoff of plain
data (ints, strings, bytes, lists, dicts), so it crosses Ray and vLLM's ``collective_rpc`` (msgpack,
``vllm/v1/serial_utils.py``) with no pickling of classes::

    {"version": int, "fingerprint": int, "device_uuid": str, "process": str, "pid": int, "nbytes": int,
     "exports": [[entry or None for each tensor, in plan order] for each receiving rank 1..K]}
    entry = {"size", "stride", "offset", "dtype", "handle", "storage_bytes", "storage_offset",
             "ref_counter", "ref_counter_offset", "event", "event_sync"}   # torch's rebuild arguments

Each receiving rank gets exports of its own: torch counts one consumer per export (a second process
opening the same export would let the learner free memory the first still reads). A 0-element tensor
travels as None. The GPU is named by its UUID, as in vLLM's ipc engine: the two processes may number
it differently (their CUDA_VISIBLE_DEVICES differ), so the receiver opens the handle on its own index
after checking that its device has the sender's UUID.

Receiver (:class:`CudaIpcReceiver`): ``receive(handoff)`` checks the plan fingerprint, the process and
the GPU, and opens every handle (``rebuild_cuda_tensor``) on its device. It never keeps the learner's
memory (the learner offloads right after the hand-over): a target whose ``swap_weights`` copies what
it is given and keeps nothing (``copies_on_swap``: vLLM's ``load_weights``) gets the opened tensors
themselves in ``swap`` and they are dropped once the copy has run (one device copy); any other target
(the Transformers engine swaps pointers) gets fresh device storage that ``receive`` copied into, and
the opened tensors go at once.

Lifetime. The sender holds nothing after ``send``: torch's CUDA IPC reference counting keeps an
exported block allocated until the receiver that opened it lets go; a block the learner frees in the
meantime waits in torch's limbo instead of returning to the allocator (pytorch
``torch/multiprocessing/multiprocessing.md``, "CUDA IPC Refcounting"; ``torch/csrc/CudaIPCTypes.cpp``).
Holding the tensors here instead would keep the learner's parameters on the GPU through its
``offload`` while vLLM generates. (vLLM's layerwise reload may keep a layer's tensors until
``finish_weight_update``, a padded layer for instance: the count keeps the learner's block until then,
and the driver offloads the learner only after the replica's update has finished.) A receiver that
refuses a handoff (wrong plan, GPU or process) gives its exports' counters back, so a refused
hand-over does not pin the learner's memory either.

Why not vLLM's own ``ipc`` weight-transfer engine (``vllm/distributed/weight_transfer/ipc_engine.py``):
it is a separate backend of ``weight_transfer_config`` (one per engine), while our worker extension
is the ``rayllm`` backend (receive while generating, bounded waits, the staging path, the tied
lm_head re-tie, the loaded-weights checksum); its update info carries ``reduce_tensor``'s raw
arguments (classes, ``torch.dtype``, ``torch.Size``), which vLLM's msgpack encoder refuses unless
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle); and it keeps one export per GPU UUID, not per
receiving process. This module uses the same torch primitives and the same UUID mapping, behind our
registry's two ends.

Phases (each failure names one): ``publish`` (a tensor missing, off the GPU or on another one),
``export i/n``, ``handoff`` (not a CUDA IPC handoff, another plan, the same process), ``device``
(another GPU), ``open i/n``, ``copy`` and ``swap`` (the device's work, each wait bounded by
``timeout_s``).
"""
from __future__ import annotations

import math
import os
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence, TypedDict

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rayllm_rl.weight_sync.buckets import TensorMeta, metas_from_spec
from rayllm_rl.weight_sync.common import WeightSyncError
from rayllm_rl.weight_sync.ends import (
    EndpointView, HandoffPlan, HeldReceiver, SenderEnd, SyncStats, TensorSource, target_dtypes,
)
from rayllm_rl.weight_sync.scheme import TransportScheme

__all__ = ["CudaIpcSender", "CudaIpcReceiver", "CudaIpcScheme", "CudaIpcHandoff", "encode_export", "decode_export",
           "export_tensor", "release_export", "gpu_uuid", "process_token", "HANDOFF_KEYS", "EXPORT_KEYS"]

_WHAT = "CUDA IPC"
_ONE_BUCKET = 1 << 62  # the plan's buckets are unused here: one entry per tensor
HANDOFF_KEYS = ("version", "fingerprint", "device_uuid", "process", "pid", "nbytes", "exports")


class CudaIpcHandoff(TypedDict):
    """One version's update info: plain data only, so it crosses Ray and vLLM's msgpack RPC as it is."""

    version: int
    fingerprint: int
    device_uuid: str
    process: str
    pid: int
    nbytes: int
    exports: list[list[dict[str, Any] | None]]
    """Per receiving rank 1..K, an export per tensor in plan order (None: a 0-element tensor)."""

EXPORT_KEYS = ("size", "stride", "offset", "dtype", "handle", "storage_bytes", "storage_offset", "ref_counter",
               "ref_counter_offset", "event", "event_sync")
_ARGS_LEN = 15  # rebuild_cuda_tensor's arguments, as reduce_tensor returns them (torch/multiprocessing/reductions.py)
_TOKEN = uuid.uuid4().hex


def process_token() -> str:
    """This process as a handoff's `process` names it, unique across pid namespaces (the token) and forks (the
    pid): CUDA IPC cannot open an export in the process that made it, so a receiver refuses a handoff with its own."""
    return f"{_TOKEN}-{os.getpid()}"


# ---------------------------------------------------------------------------- plain encoding
def encode_export(args: Sequence[Any]) -> dict[str, Any]:
    """`reduce_tensor`'s arguments for `rebuild_cuda_tensor` as plain data. Dropped: the tensor and storage
    classes (always a plain tensor over a TypedStorage), the device index (the receiver uses its own) and
    requires_grad (weights travel detached)."""
    if len(args) != _ARGS_LEN:
        raise ValueError(f"CUDA IPC export: expected rebuild_cuda_tensor's {_ARGS_LEN} arguments, got {len(args)}")
    (_tensor_cls, size, stride, offset, _storage_cls, dtype, _device, handle, storage_bytes, storage_offset,
     _requires_grad, ref_counter, ref_counter_offset, event, event_sync) = args
    return {"size": [int(s) for s in size], "stride": [int(s) for s in stride], "offset": int(offset),
            "dtype": str(dtype).removeprefix("torch."), "handle": bytes(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "ref_counter": bytes(ref_counter),
            "ref_counter_offset": int(ref_counter_offset), "event": bytes(event), "event_sync": bool(event_sync)}


def _field(entry: Mapping[str, Any], key: str, kind: type | tuple) -> Any:
    if key not in entry:
        raise ValueError(f"CUDA IPC export lacks {key!r} (has {sorted(entry)})")
    v = entry[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ValueError(f"CUDA IPC export field {key!r} is {type(v).__name__}, expected "
                         f"{getattr(kind, '__name__', kind)}")
    return v


def decode_export(entry: Mapping[str, Any], device_index: int, meta: TensorMeta | None = None) -> tuple:
    """`rebuild_cuda_tensor`'s arguments from an :func:`encode_export` dict (as msgpack returns it: lists for
    tuples), on `device_index` of this process; checked against `meta` (shape, dtype) when given."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"CUDA IPC export is {type(entry).__name__}, expected a dict")
    size = [int(s) for s in _field(entry, "size", (list, tuple))]
    stride = [int(s) for s in _field(entry, "stride", (list, tuple))]
    dtype = getattr(torch, _field(entry, "dtype", str), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"CUDA IPC export has an unknown dtype {entry['dtype']!r}")
    if len(stride) != len(size):
        raise ValueError(f"CUDA IPC export: size {size} and stride {stride} differ in length")
    if meta is not None and (tuple(size) != meta.shape or dtype != meta.dtype):
        raise ValueError(f"{meta.name}: the export is {tuple(size)}/{dtype}, the plan has {meta.shape}/{meta.dtype}")
    fields = [_field(entry, k, kind) for k, kind in (
        ("offset", int), ("handle", bytes), ("storage_bytes", int), ("storage_offset", int), ("ref_counter", bytes),
        ("ref_counter_offset", int), ("event", bytes), ("event_sync", bool))]
    offset, handle, storage_bytes, storage_offset, ref_counter, ref_counter_offset, event, event_sync = fields
    last = offset + sum((s - 1) * d for s, d in zip(size, stride))  # the tensor's last element in its storage
    if math.prod(size) and storage_bytes < (last + 1) * dtype.itemsize:
        raise ValueError(f"CUDA IPC export: a {tuple(size)} tensor at element {offset} with stride {tuple(stride)} "
                         f"does not fit its {storage_bytes}-byte storage")
    return (torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage, dtype, int(device_index),
            handle, storage_bytes, storage_offset, False, ref_counter, ref_counter_offset, event, event_sync)


def export_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC export of `t`'s own memory (no copy), as plain data; one consumer may open it once."""
    rebuild, args = reduce_tensor(t.detach())
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"a {t.device} tensor has no CUDA IPC handle (torch reduced it with {rebuild.__name__})")
    return encode_export(args)


def release_export(entry: Any, device_index: int = 0) -> None:
    """Give an unopened export's reference back (best effort), so the sender may free its block; what
    `rebuild_cuda_tensor` does for an export it already holds."""
    if not isinstance(entry, Mapping):
        return
    try:
        torch.UntypedStorage._release_ipc_counter(entry["ref_counter"], entry["ref_counter_offset"],
                                                  device=device_index)
    except Exception:  # noqa: BLE001 - the sender may be gone, or this build has no CUDA: nothing to give back
        pass


def gpu_uuid(device: torch.device | int) -> str:
    """The GPU's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _hex(v: Any) -> str:
    return f"{v:#x}" if isinstance(v, int) else repr(v)


def _wait(device: torch.device, plan: HandoffPlan, phase: str) -> None:
    """Wait (≤ the plan's timeout) for the work queued so far on `device`'s current stream."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + plan.timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise plan.error(phase, f"the GPU ({device}) did not finish the queued work", True)
        time.sleep(1e-4)


# ---------------------------------------------------------------------------- the two ends
class CudaIpcSender(EndpointView, SenderEnd):
    """Learner rank 0: exports a handle of each of its tensors per receiving rank; the handoff is plain data."""

    def __init__(self, metas: Sequence[TensorMeta], timeout_s: float, receivers: int = 1):
        if int(receivers) < 1:
            raise ValueError(f"CUDA IPC sender: receivers must be >= 1, got {receivers}")
        self._ep = HandoffPlan(metas, _ONE_BUCKET, timeout_s, 0, _WHAT)
        self.receivers = int(receivers)

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int) -> tuple[SyncStats, CudaIpcHandoff]:
        """Export every tensor of the plan (the learner's own memory: it must not change until the receivers
        have copied, i.e. no train step before the hand-over ends); returns (stats, plain handoff).

        `named` is a Mapping or (name, tensor) pairs in any order, consumed lazily (FSDP gathers in step)."""
        plan = self._ep
        t0 = time.perf_counter()
        source = TensorSource(named, {m.name for m in plan.metas})
        exports: list[list[dict | None]] = [[] for _ in range(self.receivers)]
        device: torch.device | None = None
        n = len(plan.metas)
        try:
            with plan.publishing(source):
                for i, m in enumerate(plan.metas):
                    t = plan.take(source, m, "publish").detach()
                    if t.device.type != "cuda" or (device is not None and t.device != device):
                        raise plan.error("publish", f"{m.name} is on {t.device}"
                                         + (f", the tensors before it on {device}" if device is not None else "")
                                         + ": CUDA IPC hands over the tensors of one GPU (is the learner onloaded?)")
                    device = t.device
                    try:
                        for k in range(self.receivers):
                            exports[k].append(export_tensor(t) if t.numel() else None)
                    except Exception as exc:
                        raise plan.error(f"export {i + 1}/{n}", f"{m.name}: {type(exc).__name__}: {exc}") from exc
                _wait(device, plan, "publish")  # the bytes are final before a receiver reads them
                handoff = CudaIpcHandoff(version=int(version), fingerprint=plan.fingerprint,
                                         device_uuid=gpu_uuid(device), process=process_token(), pid=os.getpid(),
                                         nbytes=plan.total_bytes, exports=exports)
        except BaseException:
            for entry in (e for per_rank in exports for e in per_rank):  # nobody will open these
                release_export(entry, device.index if device is not None else 0)
            raise
        torch.cuda.ipc_collect()  # free earlier versions' blocks the receivers have let go
        return plan.sent(t0, n, version), handoff

    def close(self) -> None:
        """Free blocks the receivers have let go (nothing else is held here)."""
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()


def _receiving_device(target: Any) -> torch.device:
    """The GPU `target` keeps its weights on: its `device`, else its parameters' (meta ones skipped)."""
    dev = getattr(target, "device", None)
    if dev is None:
        devs = {p.device for p in target.named_parameters().values() if p.device.type != "meta"}
        dev = devs.pop() if len(devs) == 1 else None
    dev = torch.device(dev) if dev is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"ray.sync_transport=cuda_ipc: this receiver's weights are on {dev or 'no single device'} "
                         f"and torch {'sees a GPU' if torch.cuda.is_available() else 'sees no GPU'} "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): CUDA IPC hands weights "
                         "over on a GPU the learner and this replica share")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaIpcReceiver(HeldReceiver):
    """A receiving process on the learner's GPU: opens the handoff's handles and hands the tensors to `target`.

    `target` offers ``named_parameters()`` (names, shapes, dtypes it takes), ``swap_weights(dict, version)
    -> stall_s``, optionally ``device`` (where its weights live) and ``copies_on_swap`` (its swap copies
    what it is given and keeps no reference). `device` / `device_uuid` default to the target's GPU and
    its UUID."""

    def __init__(self, target: Any, metas: Sequence[TensorMeta], timeout_s: float, rank: int = 1, *,
                 device: torch.device | str | None = None, device_uuid: str | None = None):
        self._ep = HandoffPlan(metas, _ONE_BUCKET, timeout_s, rank, _WHAT)
        self._dtypes = target_dtypes(target, self._ep.metas, "CudaIpcReceiver")
        self.device = torch.device(device) if device is not None else _receiving_device(target)
        self.device_uuid = device_uuid if device_uuid is not None else gpu_uuid(self.device)
        self.copies_on_swap = bool(getattr(target, "copies_on_swap", False))
        """Hand the opened tensors themselves to the target (it copies them in `swap_weights`)."""
        self.target = target

    def _exports(self, handoff: Any) -> list:
        """This rank's exports of a handoff that fits this receiver; else raises naming the phase."""
        plan = self._ep
        if not isinstance(handoff, Mapping) or any(k not in handoff for k in HANDOFF_KEYS):
            got = sorted(handoff) if isinstance(handoff, Mapping) else type(handoff).__name__
            raise plan.error("handoff", f"expected a CUDA IPC sender's handoff with {list(HANDOFF_KEYS)}, got {got}")
        exports = handoff["exports"]
        mine = exports[plan.rank - 1] if isinstance(exports, list) and 0 < plan.rank <= len(exports) else None
        try:
            if handoff["fingerprint"] != plan.fingerprint:
                raise plan.error("handoff", f"version {handoff['version']} was sent with plan "
                                            f"{_hex(handoff['fingerprint'])}, this receiver's is "
                                            f"{_hex(plan.fingerprint)}: sender and receiver must use the same metas")
            if not isinstance(mine, list) or len(mine) != len(plan.metas):
                ranks = len(exports) if isinstance(exports, list) else 0
                raise plan.error("handoff", f"the handoff carries no export list of {len(plan.metas)} tensors for "
                                            f"rank {plan.rank} (it has {ranks} receiving ranks)")
            if handoff["process"] == process_token():
                raise plan.error("handoff", f"sender and receiver are one process (pid {os.getpid()}): CUDA IPC "
                                            "cannot open a handle where it was exported; use ray.sync_transport="
                                            "object_store")
            if handoff["device_uuid"] != self.device_uuid:
                raise plan.error("device", f"the learner's tensors are on GPU {handoff['device_uuid']}, this receiver "
                                           f"is on GPU {self.device_uuid} ({self.device} here): CUDA IPC hands weights "
                                           "over on one GPU, which learner rank 0 and this replica must share "
                                           "(ray.placement=colocated with ray.num_learners=1)")
        except WeightSyncError:
            for entry in mine or ():  # refused: the learner may free what it exported for this rank
                release_export(entry, self.device.index or 0)
            raise
        return mine

    def receive(self, handoff: CudaIpcHandoff, *, header_timeout_s: float | None = None) -> int:
        """Open every export of this rank on this GPU (and copy into fresh storage unless the target copies
        on swap); returns the version. `header_timeout_s` is unused: the handoff arrives with the call."""
        plan = self._ep
        mine = self._exports(handoff)
        t0 = time.perf_counter()
        n, index = len(plan.metas), self.device.index or 0
        named: dict[str, torch.Tensor] = {}
        opened = 0  # exports handed to torch (released when their tensor goes)
        try:
            for i, (m, entry) in enumerate(zip(plan.metas, mine)):
                dtype = self._dtypes[m.name]
                if entry is None:  # a 0-element tensor: nothing was exported
                    if m.numel:
                        raise plan.error(f"open {i + 1}/{n}", f"{m.name} has {m.numel} elements and no export")
                    named[m.name] = torch.empty(m.shape, dtype=dtype, device=self.device)
                    opened = i + 1
                    continue
                try:
                    args = decode_export(entry, index, m)
                except ValueError as exc:
                    raise plan.error("handoff", f"export {i + 1}/{n}: {exc}") from exc
                try:
                    with torch.cuda.device(self.device):  # torch opens the handle on the current device
                        view = rebuild_cuda_tensor(*args)
                except Exception as exc:
                    raise plan.error(f"open {i + 1}/{n}", f"{m.name}: {type(exc).__name__}: {exc}") from exc
                opened = i + 1
                if self.copies_on_swap and view.dtype == dtype:
                    named[m.name] = view
                else:  # storage of the receiver's own, in the target's dtype; the learner's block goes below
                    named[m.name] = torch.empty(m.shape, dtype=dtype, device=self.device).copy_(view)
                del view
            if not self.copies_on_swap:
                _wait(self.device, plan, "copy")
        except BaseException:
            named.clear()
            for entry in mine[opened:]:
                release_export(entry, index)
            raise
        return self._hold(handoff["version"], named, t0, n)

    def swap(self, version: int | None = None) -> float:
        """Hand the received tensors to the target; returns the stall (s). Tensors over the learner's memory
        are dropped only once the target's copies out of them have run (bounded)."""
        if self._received is None:
            raise RuntimeError("CudaIpcReceiver.swap: nothing received since the last swap")
        received, named = self._received
        self._received = None
        try:
            stall = float(self.target.swap_weights(named, received if version is None else int(version)))
            if self.copies_on_swap:
                _wait(self.device, self._ep, "swap")
            return stall
        except WeightSyncError:
            raise
        except Exception as exc:
            raise self._ep.error("swap", f"{type(exc).__name__}: {exc}") from exc
        finally:
            named.clear()


class CudaIpcScheme(TransportScheme):
    """cuda_ipc: nothing to agree on beforehand; each version's handoff is plain data (`HANDOFF_KEYS`),
    with exports of its own for each receiving rank."""

    def sender(self, spec, metas: Sequence[TensorMeta]) -> CudaIpcSender:
        return CudaIpcSender(metas, spec.timeout_s, receivers=spec.world_size - 1)

    def receiver(self, spec, target: Any) -> CudaIpcReceiver:
        return CudaIpcReceiver(target, metas_from_spec(spec.metas), spec.timeout_s, spec.rank)
