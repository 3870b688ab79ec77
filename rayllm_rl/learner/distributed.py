"""FSDP2 plumbing for the learner: process group, device mesh, sharding, full-tensor gathers.

Every helper that gathers (`iter_full_tensors`, `all_gather_objects`) is a collective: every
rank must call it, in the same order, or the group hangs until `DistConfig.timeout_s`.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rayllm_rl.rendezvous import join_store, listen_store


@dataclasses.dataclass
class DistConfig:
    """Where this learner rank sits in its data-parallel (FSDP2) group."""

    rank: int = 0
    """This process's rank in [0, world_size)."""
    world_size: int = 1
    """Number of learner ranks; 1 = plain single-process training (no process group)."""
    master_addr: str = "127.0.0.1"
    """Address of the group's TCP rendezvous store."""
    master_port: int = 0
    """Port of that store (0: `$MASTER_PORT`; required when world_size > 1 unless rank 0 passes `store`)."""
    backend: str = "gloo"
    """"gloo" (CPU) or "nccl" (one GPU per rank, `cuda:$LOCAL_RANK` or `cuda:rank % ngpus`)."""
    timeout_s: float = 120.0
    """Timeout of every collective; a missing rank fails loudly instead of hanging forever."""
    store: Any = None
    """Rank 0's store, already listening (`rendezvous.listen_store`), whose port the other ranks were given
    after it was bound (the Ray learners: rank 0's `rendezvous`). None: rank 0 binds `master_port` itself."""
    launcher_store: bool = False
    """The launcher serves the store (`launch_local`, as torchrun's agent does) and every rank joins it."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def init_distributed(cfg: DistConfig):
    """Join the default process group (reused if already initialised) and return a 1-D DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", cfg.rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
    if dist.is_initialized():
        if dist.get_world_size() != cfg.world_size or dist.get_rank() != cfg.rank:
            raise RuntimeError(
                f"a process group (rank {dist.get_rank()}/{dist.get_world_size()}) already exists; "
                f"DistConfig asks for rank {cfg.rank}/{cfg.world_size}")
    else:
        dist.init_process_group(cfg.backend, store=rendezvous_store(cfg), rank=cfg.rank, world_size=cfg.world_size,
                                timeout=datetime.timedelta(seconds=cfg.timeout_s))
    return init_device_mesh(cfg.device_type, (cfg.world_size,))


def rendezvous_store(cfg: DistConfig):
    """This rank's handle on the group's store: rank 0's own (`cfg.store`, or bound here on `master_port`,
    a port the OS gives for a lone rank), else a client of `master_addr:master_port`."""
    if cfg.store is not None:
        return cfg.store
    port = cfg.master_port or int(os.environ.get("MASTER_PORT", "0"))
    if cfg.rank == 0 and not cfg.launcher_store:
        if port == 0 and cfg.world_size > 1:
            raise ValueError("DistConfig.master_port (or $MASTER_PORT) or rank 0's listening `store` is required "
                             "when world_size > 1")
        if port == 0:  # a lone rank: nobody needs to be told where
            return listen_store(cfg.master_addr, 1, cfg.timeout_s)
        return dist.TCPStore(cfg.master_addr, port, cfg.world_size, is_master=True,  # a port the user fixed
                             timeout=datetime.timedelta(seconds=cfg.timeout_s), wait_for_workers=False)
    return join_store(cfg.master_addr, port, cfg.world_size, cfg.timeout_s)


def destroy_distributed() -> None:
    """Leave and destroy the default process group (no-op when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (`model.model.layers` and the usual variants)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def shard_model(model: torch.nn.Module, mesh, mp_policy=None) -> torch.nn.Module:
    """FSDP2 `fully_shard` every decoder layer, then the root (embeddings, final norm, lm_head).

    Tied embeddings stay tied: embed_tokens and lm_head share one Parameter, which lands in the
    root's parameter group, and FSDP2 swaps in one DTensor Parameter on both modules. Gradient
    reduction is a plain SUM (divide factor 1): the learner already normalises every rank's loss
    by the GLOBAL token / sequence count, so summing ranks gives the full-batch gradient.
    Parameter names are unchanged (FSDP2 adds no wrapper modules). `mp_policy`: FSDP2's
    `MixedPrecisionPolicy` (learner/precision.py), or None (gathered and reduced in the parameters' dtype).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = emb is not None and head is not None and head.weight is emb.weight
    extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("fully_shard untied lm_head.weight from embed_tokens.weight")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # Plain SUM reduce-scatter (+ a no-op divide by 1): without it the factor maps to
            # ReduceOp.PREMUL_SUM, which gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
            m.set_force_sum_reduction_for_comms(True)
    return model


def iter_full_tensors(model: torch.nn.Module, named: dict[str, torch.Tensor] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, full detached tensor)` for every parameter, in `named_parameters()` order (or for
    the `named` parameters of `model`, by those names: a LoRA adapter by PEFT name).

    DTensors are gathered with `full_tensor()` (a collective: every rank must exhaust this
    iterator in lockstep); plain tensors are yielded as is. Names equal the unsharded model's
    (tied weights appear once, as in `named_parameters()`), so an inference engine loads them.
    """
    from torch.distributed.tensor import DTensor

    for name, p in (named.items() if named is not None else model.named_parameters()):
        t = p.detach()
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


def to_local_scalar(x: torch.Tensor | float) -> float:
    """A float from a tensor that may be a (Replicate) DTensor, e.g. clip_grad_norm_'s result."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable) on every rank; `[obj]` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank; `obj` itself without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _ResultQueue:
    """Queue whose items travel as torch.save bytes: tensors are copied, not shared by fd.

    (torch.multiprocessing shares tensor storage through file descriptors, which vanish when
    the child exits before the parent has read the item.)
    """

    def __init__(self, q) -> None:
        self._q = q

    def put(self, obj: Any) -> None:
        import io

        buf = io.BytesIO()
        torch.save(obj, buf)
        self._q.put(buf.getvalue())

    def get(self, timeout: float | None = None) -> Any:
        import io

        return torch.load(io.BytesIO(self._q.get(timeout=timeout)), weights_only=False)


def launch_local(fn, world_size: int, *args: Any, timeout_s: float = 300.0) -> dict[int, Any]:
    """Run `fn(dist, queue, *args)` in `world_size` spawned local processes, `dist` being each rank's
    `DistConfig` (gloo): this process serves the group's store, bound before the ranks start, as torchrun's
    agent does.

    Each rank may `queue.put((rank, payload))` once; returns `{rank: payload}` once every rank has
    exited. A rank's exception is re-raised here (with its traceback); past `timeout_s` every
    child is killed and TimeoutError raised. For tests and single-node runs without Ray.
    `fn` must be importable (a module-level function) and the payloads picklable.
    """
    import queue as queue_mod
    import time

    import torch.multiprocessing as mp

    store = listen_store("127.0.0.1", world_size + 1, timeout_s)  # + this process, which serves it
    q = _ResultQueue(mp.get_context("spawn").Queue())
    ctx = mp.start_processes(_launched_rank, args=(fn, world_size, int(store.port), q, *args), nprocs=world_size,
                             join=False, start_method="spawn")
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        done = False
        while not done:
            try:  # drain first: a child blocks at exit until its queued payload is read
                rank, payload = q.get(timeout=0.2)
                results[rank] = payload
                continue
            except queue_mod.Empty:
                pass
            done = ctx.join(timeout=0.01)  # raises ProcessRaisedException / ProcessExitedException
            if not done and time.monotonic() > deadline:
                raise TimeoutError(f"launch_local: ranks still running after {timeout_s}s")
        while True:
            try:
                rank, payload = q.get(timeout=0.05)
                results[rank] = payload
            except queue_mod.Empty:
                break
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return results


def _launched_rank(rank: int, fn, world_size: int, port: int, queue, *args: Any) -> None:
    """A `launch_local` rank: its DistConfig joins the launcher's store."""
    fn(DistConfig(rank, world_size, master_port=port, launcher_store=True), queue, *args)
