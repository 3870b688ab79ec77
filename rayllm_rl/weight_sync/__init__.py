"""Weight synchronisation from the learner to the inference replicas.

* :mod:`~rayllm_rl.weight_sync.registry`: the one place that plans a transport from the
  placement and builds its sending and receiving ends (:class:`SyncSpec`); engines receive
  through it and never branch on a transport's name.
* :mod:`~rayllm_rl.weight_sync.object_store`: Ray's object store (the default on CPU and across
  nodes): learner rank 0 puts buckets, the driver passes the references, replicas fetch them.
  Imported only when built (it imports ray).
* :mod:`~rayllm_rl.weight_sync.shm`: a shared-memory double buffer on the learner's node.
* :mod:`~rayllm_rl.weight_sync.transport`: :class:`WeightSender` / :class:`WeightReceiver`
  (header + vote + buckets + ack over a group, every phase bounded) and
  :class:`DoubleBufferReceiver` (receive while generating, then an O(1) swap between decode steps).
* :mod:`~rayllm_rl.weight_sync.gloo_group`: :class:`StatelessGlooGroup` / :class:`StatelessNcclGroup`,
  private groups that leave the global ``torch.distributed`` state alone (so they live beside FSDP).
* :mod:`~rayllm_rl.weight_sync.buckets`: metadata, deterministic bucket plans, pack / unpack.
"""
from __future__ import annotations

from rayllm_rl.weight_sync.buckets import (
    TensorMeta, bucket_numel, metadata_of, metas_from_spec, metas_to_spec, pack, plan_buckets, plan_fingerprint,
    unpack_into,
)
from rayllm_rl.weight_sync.gloo_group import (
    StatelessGlooGroup, StatelessNcclGroup, WeightSyncError, WeightSyncTimeout, find_free_port,
)
from rayllm_rl.weight_sync.transport import (
    DEFAULT_BUCKET_BYTES, DoubleBufferReceiver, SyncStats, WeightReceiver, WeightSender,
)
from rayllm_rl.weight_sync.shm import ShmLayout, ShmWeightReceiver, ShmWeightSender, plan_layout  # noqa: E402

__all__ = [
    "TensorMeta", "metadata_of", "plan_buckets", "plan_fingerprint", "bucket_numel", "pack", "unpack_into",
    "metas_to_spec", "metas_from_spec", "StatelessNcclGroup", "StatelessGlooGroup", "WeightSyncError",
    "WeightSyncTimeout", "find_free_port", "SyncStats", "WeightSender", "WeightReceiver", "DoubleBufferReceiver",
    "DEFAULT_BUCKET_BYTES", "ShmWeightSender", "ShmWeightReceiver", "ShmLayout", "plan_layout",
]
