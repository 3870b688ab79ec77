"""A group's rendezvous store, bound by the process that serves it and published afterwards.

A port found free and bound later can be taken in between by any process on the node (Ray alone opens
dozens), so no port is picked ahead here: rank 0 binds its `TCPStore` on a port the OS gives it (or on a
port asked for, falling back to one the OS gives when that one is taken), and only then is `store.port`
handed to the other members, who join as clients. Used by the learner's FSDP group and by every
weight-sync group (gloo, NCCL, and the shm transport's control group).
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

__all__ = ["listen_store", "join_store", "is_address_in_use"]

log = logging.getLogger(__name__)


def is_address_in_use(exc: BaseException) -> bool:
    """Whether a failed listen was refused because the port is taken (c10d says EADDRINUSE)."""
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def listen_store(host: str, world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0's store, listening on `host` now; its `.port` is what the other members are told.

    `port`: one to try first (0: the OS picks at once). When it is taken, the OS picks another: the caller
    publishes `.port`, never the port it asked for. Clients may connect as soon as this returns; the
    group's own construction waits (≤ its timeout) for all of them."""
    ask = int(port)
    for attempt in (ask, 0) if ask else (0,):
        try:
            return dist.TCPStore(host, attempt, int(world_size), is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=float(timeout_s)))
        except dist.DistNetworkError as exc:
            if attempt == 0 or not is_address_in_use(exc):
                raise
            log.info("rendezvous port %d on %s is taken; listening on one the OS picks instead", attempt, host)
    raise AssertionError("unreachable")  # the loop returns or raises


def join_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A member's client of the store rank 0 serves at `host:port` (connect retries until `timeout_s`)."""
    if not int(port) > 0:
        raise ValueError(f"rendezvous at {host}:{port}: no port; rank 0 binds its store first and publishes "
                         "`store.port` (rayllm_rl.rendezvous.listen_store)")
    return dist.TCPStore(host, int(port), int(world_size), is_master=False,
                         timeout=timedelta(seconds=float(timeout_s)))
