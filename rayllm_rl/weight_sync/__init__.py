"""Weight synchronisation from the learner to the inference replicas.

* :mod:`~rayllm_rl.weight_sync.gloo_group`: :class:`StatelessGlooGroup`, a private CPU gloo
  group that leaves the global ``torch.distributed`` state alone (so it lives beside FSDP).
* :mod:`~rayllm_rl.weight_sync.buckets`: metadata, deterministic bucket plans, pack / unpack.
* :mod:`~rayllm_rl.weight_sync.transport`: :class:`WeightSender` / :class:`WeightReceiver`
  (header + vote + buckets + ack, every phase bounded) and :class:`DoubleBufferReceiver`
  (receive while generating, then an O(1) swap between decode steps).
* :mod:`~rayllm_rl.weight_sync.ray_collective`: :class:`RayCollectiveGroup` over
  ``ray.util.collective`` (NCCL on GPU); imported lazily so that importing this package
  does not import ray.
"""
from __future__ import annotations

from rayllm_rl.weight_sync.buckets import (
    TensorMeta, bucket_numel, metadata_of, metas_from_spec, metas_to_spec, pack, plan_buckets, plan_fingerprint,
    unpack_into,
)
from rayllm_rl.weight_sync.gloo_group import (
    TRANSPORTS, StatelessGlooGroup, StatelessNcclGroup, WeightSyncError, WeightSyncTimeout, find_free_port, make_group,
)
from rayllm_rl.weight_sync.transport import (
    DEFAULT_BUCKET_BYTES, DoubleBufferReceiver, SyncStats, WeightReceiver, WeightSender,
)

_LAZY = {"RayCollectiveGroup", "register_stateless_gloo_backend", "STATELESS_GLOO"}

__all__ = [
    "TensorMeta", "metadata_of", "plan_buckets", "plan_fingerprint", "bucket_numel", "pack", "unpack_into",
    "metas_to_spec", "metas_from_spec", "TRANSPORTS", "StatelessNcclGroup", "make_group",
    "StatelessGlooGroup", "WeightSyncError", "WeightSyncTimeout", "find_free_port",
    "SyncStats", "WeightSender", "WeightReceiver", "DoubleBufferReceiver", "DEFAULT_BUCKET_BYTES",
    *sorted(_LAZY),
]


def __getattr__(name: str):
    if name in _LAZY:  # ray is imported only when the Ray transport is asked for
        from rayllm_rl.weight_sync import ray_collective

        return getattr(ray_collective, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Same-node transport through two shared-memory segments (a double buffer across processes).
from rayllm_rl.weight_sync.shm import ShmLayout, ShmWeightReceiver, ShmWeightSender, plan_layout  # noqa: E402

__all__ += ["ShmWeightSender", "ShmWeightReceiver", "ShmLayout", "plan_layout"]
