"""A replica-local staging segment: how weights fetched in the replica actor reach vLLM's worker.

vLLM keeps its weights in a worker process it spawns itself, which is not a Ray worker, so it
cannot fetch from Ray's object store. For a transport whose receiver needs Ray
(`TransportInfo.receiver_needs_ray`), the replica actor fetches (zero-copy) and writes the
tensors into one shared-memory segment of its own (one memcpy, while vLLM keeps generating); the
worker maps it read-only and copies from it with `model.load_weights` during the paused update.

One segment is enough: vLLM copies the weights in, so once an update is applied the segment is
free again, and the next write starts only after that (one update at a time per replica).
Layout: `weight_sync.shm_segments.plan_layout` (every tensor at a 64-byte aligned offset).
"""
from __future__ import annotations

import time
import uuid
import warnings
from multiprocessing import shared_memory
from typing import Mapping, Sequence

import torch

from rayllm_rl.weight_sync.buckets import TensorMeta
from rayllm_rl.weight_sync.shm_segments import attach_readonly, plan_layout, tensor_at

__all__ = ["StagingWriter", "StagingReader"]


class StagingWriter:
    """Actor side: owns the segment; a receiver's target (`named_parameters`, `swap_weights`)."""

    def __init__(self, metas: Sequence[TensorMeta]):
        self.metas = list(metas)
        self.layout = plan_layout(self.metas)
        self.name = f"rayllm_stage_{uuid.uuid4().hex[:12]}"
        try:
            self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=max(self.layout.nbytes, 64))
        except OSError as exc:
            raise OSError(f"staging segment for vLLM's worker: cannot create {self.layout.nbytes} bytes in /dev/shm "
                          f"({exc}); raise the shared-memory size (e.g. docker --shm-size)") from exc
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self._dst = {s.meta.name: tensor_at(self._shm.buf, s.meta, s.offset) for s in self.layout.slots}
        self.write_s = 0.0

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {m.name: torch.empty(m.shape, dtype=m.dtype, device="meta") for m in self.metas}

    def swap_weights(self, named: Mapping[str, torch.Tensor], version: int) -> float:
        """Copy `named` into the segment (vLLM still generates: this holds nothing); returns 0."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, t in named.items():
                self._dst[name].copy_(t)
        self.write_s = time.perf_counter() - t0
        return 0.0

    def close(self) -> None:
        """Unlink the segment (idempotent); the worker's read-only mapping stays valid until dropped."""
        shm, self._shm = self._shm, None
        self._dst = {}
        if shm is not None:
            for op in (shm.close, shm.unlink):
                try:
                    op()
                except (FileNotFoundError, BufferError):
                    pass


class StagingReader:
    """Worker side: read-only views of the writer's segment, by HF name."""

    def __init__(self, name: str, metas: Sequence[TensorMeta]):
        self.layout = plan_layout(list(metas))
        self._map, _ = attach_readonly(name, self.layout.nbytes)

    def views(self) -> dict[str, torch.Tensor]:
        with warnings.catch_warnings():  # "buffer is not writable": read-only on purpose
            warnings.simplefilter("ignore", UserWarning)
            return {s.meta.name: tensor_at(self._map, s.meta, s.offset) for s in self.layout.slots}
