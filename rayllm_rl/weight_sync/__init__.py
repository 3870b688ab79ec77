"""Weight synchronisation from the learner to the inference replicas.

* :mod:`~rayllm_rl.weight_sync.registry`: the one place that knows transports by name: their
  properties, the plan from the placement, and a name -> scheme table; builds a setup's sending and
  receiving ends (:class:`SyncSpec`). Engines receive through the ends and never branch on a name.
* :mod:`~rayllm_rl.weight_sync.scheme`: a transport as a scheme, and the typed init infos of a setup.
* :mod:`~rayllm_rl.weight_sync.ends`: the public shape of both ends (:class:`SenderEnd`,
  :class:`ReceiverEnd`) and the pieces transports build them from.
* One module per transport, each with its scheme: :mod:`~rayllm_rl.weight_sync.broadcast` (gloo, nccl:
  header + vote + buckets + ack over a group, every phase bounded; a double-buffered receiver),
  :mod:`~rayllm_rl.weight_sync.shm`, :mod:`~rayllm_rl.weight_sync.object_store`,
  :mod:`~rayllm_rl.weight_sync.ray_channel`, :mod:`~rayllm_rl.weight_sync.ray_direct`,
  :mod:`~rayllm_rl.weight_sync.cuda_ipc` (the Ray ones import Ray, and only when built).
* :mod:`~rayllm_rl.weight_sync.common`: the errors every transport raises, `Closing`.
* :mod:`~rayllm_rl.weight_sync.gloo_group`: :class:`StatelessGlooGroup` / :class:`StatelessNcclGroup`,
  private groups that leave the global ``torch.distributed`` state alone (so they live beside FSDP).
* :mod:`~rayllm_rl.weight_sync.buckets`: metadata, deterministic bucket plans, pack / unpack;
  :mod:`~rayllm_rl.weight_sync.shm_segments`: the flat layout of a shared-memory segment.
"""
from __future__ import annotations

from rayllm_rl.weight_sync.buckets import (
    TensorMeta, bucket_numel, metadata_of, metas_from_spec, metas_to_spec, pack, plan_buckets, plan_fingerprint,
    unpack_into,
)
from rayllm_rl.weight_sync.common import WeightSyncError, WeightSyncTimeout
from rayllm_rl.weight_sync.gloo_group import StatelessGlooGroup, StatelessNcclGroup
from rayllm_rl.weight_sync.ends import ReceiverEnd, SenderEnd, SyncStats
from rayllm_rl.weight_sync.broadcast import DEFAULT_BUCKET_BYTES, DoubleBufferReceiver, WeightReceiver, WeightSender
from rayllm_rl.weight_sync.shm import ShmWeightReceiver, ShmWeightSender
from rayllm_rl.weight_sync.shm_segments import ShmLayout, plan_layout

__all__ = [
    "TensorMeta", "metadata_of", "plan_buckets", "plan_fingerprint", "bucket_numel", "pack", "unpack_into",
    "metas_to_spec", "metas_from_spec", "StatelessNcclGroup", "StatelessGlooGroup", "WeightSyncError",
    "WeightSyncTimeout", "SyncStats", "SenderEnd", "ReceiverEnd", "WeightSender", "WeightReceiver",
    "DoubleBufferReceiver", "DEFAULT_BUCKET_BYTES", "ShmWeightSender", "ShmWeightReceiver", "ShmLayout", "plan_layout",
]
