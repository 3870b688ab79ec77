"""A transport as a scheme: how its two ends are built, and the typed init info they are built from.

Each transport module defines one :class:`TransportScheme` subclass; the registry's table maps a
transport's name to it. A scheme makes the init info of a setup (:meth:`TransportScheme.init_info`: the
rendezvous, segment names or reader handles its ends need, in place of an untyped dict), builds learner
rank 0's end (:meth:`~TransportScheme.sender`) and each receiving process's end
(:meth:`~TransportScheme.receiver`). A sender-first transport (Ray channels) also says what its sender
made for the receivers (:meth:`~TransportScheme.receivers_init`). Nothing here imports Ray: an init info
may hold Ray handles, but only a Ray transport makes or reads them.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Sequence

from rayllm_rl.weight_sync.buckets import TensorMeta
from rayllm_rl.weight_sync.ends import GroupReceiver, GroupSender, ReceiverEnd, SenderEnd

Spec = Any
"""A setup's `SyncSpec` (defined by the registry, which imports this module)."""

__all__ = ["InitInfo", "NoInit", "GroupInit", "ShmInit", "ChannelInit", "ChannelAttach", "init_from_dict",
           "TransportScheme", "GroupScheme"]


@dataclasses.dataclass(frozen=True)
class InitInfo:
    """What a setup's ends are built from, besides the metas, ranks and timeouts every setup has."""

    def as_dict(self) -> dict[str, Any]:
        """Plain fields and the class's name (crosses into vLLM's worker, whose RPC carries dicts)."""
        return {"kind": type(self).__name__, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class NoInit(InitInfo):
    """Nothing to agree on beforehand: each version's handoff says it all (object store, RDT, CUDA IPC)."""


@dataclasses.dataclass(frozen=True)
class GroupInit(InitInfo):
    """A group's rendezvous: learner rank 0's host and the port of its TCP store (gloo, nccl)."""

    host: str
    port: int


@dataclasses.dataclass(frozen=True)
class ShmInit(GroupInit):
    """The control group's rendezvous and the names of the two shared-memory segments (shm)."""

    segments: tuple[str, str] = ("", "")


@dataclasses.dataclass(frozen=True)
class ChannelInit(InitInfo):
    """For learner rank 0: (actor handle, node id) of every receiving process (ray_channel)."""

    readers: tuple[tuple[Any, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class ChannelAttach(InitInfo):
    """For the receivers: the two channels learner rank 0 made (ray_channel)."""

    channels: tuple[Any, ...] = ()


_KINDS = {cls.__name__: cls for cls in (NoInit, GroupInit, ShmInit, ChannelInit, ChannelAttach)}


def init_from_dict(d: Mapping[str, Any] | None) -> InitInfo:
    """The init info `InitInfo.as_dict` wrote (tuples come back as lists through msgpack)."""
    d = dict(d or {"kind": "NoInit"})
    cls = _KINDS.get(d.pop("kind", None))
    if cls is None:
        raise ValueError(f"weight sync: unknown init info {d!r}; kinds are {tuple(_KINDS)}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return cls(**fields)


class TransportScheme(abc.ABC):
    """One transport: its init info and its two ends. Built with the transport's `TransportInfo`."""

    def __init__(self, info: Any):
        self.info = info
        """The transport's `TransportInfo` (its name and properties)."""

    def init_info(self, *, receivers: int, host: str = "", port: int = 0,
                  readers: Sequence[tuple[Any, str]] = ()) -> InitInfo:
        """The init info of a setup with `receivers` receiving processes (learner rank 0's `host` and
        `port` for a group; `readers` for a sender-first transport). Default: nothing to agree on."""
        return NoInit()

    @abc.abstractmethod
    def sender(self, spec: Spec, metas: Sequence[TensorMeta]) -> SenderEnd:
        """Learner rank 0's end (metas already checked against `spec.metas`)."""

    @abc.abstractmethod
    def receiver(self, spec: Spec, target: Any) -> ReceiverEnd:
        """The end of the receiving process `spec.rank` for `target` (``named_parameters()``,
        ``swap_weights(dict, version) -> stall_s``)."""

    def receivers_init(self, spec: Spec, sender: SenderEnd) -> InitInfo:
        """The init info the receivers are built from, once learner rank 0's end exists: the spec's own,
        except for a sender-first transport (`TransportInfo.sender_first`), whose sender makes it."""
        return spec.init


class GroupScheme(TransportScheme):
    """A transport whose ends form a group at learner rank 0's host and port (gloo, nccl, shm): each end
    owns its group; a failure while building an end closes the group."""

    def init_info(self, *, receivers: int, host: str = "", port: int = 0,
                  readers: Sequence[tuple[Any, str]] = ()) -> InitInfo:
        if not host or not port:
            raise ValueError(f"weight sync over {self.info.name}: learner rank 0's host and port are needed")
        return GroupInit(host, int(port))

    def group(self, spec: Spec, rank: int):
        """Join the setup's group as `rank` (waits ≤ timeout for every member)."""
        from rayllm_rl.weight_sync.gloo_group import StatelessGlooGroup, StatelessNcclGroup

        cls = StatelessNcclGroup if self.info.gpu_only else StatelessGlooGroup
        return cls(spec.init.host, spec.init.port, rank, spec.world_size, spec.timeout_s)

    def sender(self, spec: Spec, metas: Sequence[TensorMeta]) -> SenderEnd:
        group = self.group(spec, 0)
        try:
            return GroupSender(self.sender_in(group, spec, metas), group)
        except BaseException:
            group.close()
            raise

    def receiver(self, spec: Spec, target: Any) -> ReceiverEnd:
        group = self.group(spec, spec.rank)
        try:
            return GroupReceiver(self.receiver_in(group, spec, target), group)
        except BaseException:
            group.close()
            raise

    @abc.abstractmethod
    def sender_in(self, group: Any, spec: Spec, metas: Sequence[TensorMeta]) -> Any:
        """The protocol's sender on `group` (its `send` returns the stats only)."""

    @abc.abstractmethod
    def receiver_in(self, group: Any, spec: Spec, target: Any) -> ReceiverEnd:
        """The protocol's receiver on `group`."""
