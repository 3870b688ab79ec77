"""A transport as a scheme: how its two ends are built, and the typed init info they are built from.

Each transport module defines one :class:`TransportScheme` subclass; the registry's table maps a
transport's name to it. A scheme makes the init info of a setup (:meth:`TransportScheme.init_info`: the
rendezvous, segment names or reader handles its ends need, in place of an untyped dict), opens learner
rank 0's end (:meth:`~TransportScheme.open_sender`) and builds each receiving process's end
(:meth:`~TransportScheme.receiver`). Learner rank 0's end is opened before any receiver is told where to
connect: a group binds its store there (the port goes to the receivers in the opened end's `init`), Ray
channels make their channels; nothing is picked ahead and bound later. Nothing here imports Ray: an init
info may hold Ray handles, but only a Ray transport makes or reads them.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping, Sequence

from rayllm_rl.weight_sync.buckets import TensorMeta
from rayllm_rl.weight_sync.ends import GroupReceiver, GroupSender, ReceiverEnd, SenderEnd

Spec = Any
"""A setup's `SyncSpec` (defined by the registry, which imports this module)."""

__all__ = ["InitInfo", "NoInit", "GroupInit", "ShmInit", "ChannelInit", "ChannelAttach", "init_from_dict",
           "OpenedSender", "TransportScheme", "GroupScheme"]


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
    """A group's rendezvous: learner rank 0's host and the port of its TCP store (gloo, nccl). The driver's
    spec has port 0 (or a port to try first); the port rank 0 bound comes back in its opened end's init."""

    host: str
    port: int = 0


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


class OpenedSender:
    """Learner rank 0's end, opened: `init` is what the receivers are built from (hand them
    `spec.with_init(opened.init)`); :meth:`finish` completes the end (a group waits there, ≤ its timeout,
    for every receiver to join, so it runs while they join)."""

    def __init__(self, init: InitInfo, finish: Callable[[], SenderEnd], close: Callable[[], None] = lambda: None):
        self.init = init
        self._finish, self._close = finish, close
        self._done = False

    def finish(self) -> SenderEnd:
        if self._done:
            raise RuntimeError("weight sync: this opened sender was finished or closed already; open a new one")
        self._done = True
        finish, self._finish = self._finish, None  # what it holds (a bound store) goes with the finished end
        try:
            return finish()
        except BaseException:
            self._close()
            raise

    def close(self) -> None:
        """Release what opening bound or made, if it was never finished (idempotent)."""
        if not self._done:
            self._done, self._finish = True, None
            self._close()


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

    def open_sender(self, spec: Spec, metas: Sequence[TensorMeta]) -> OpenedSender:
        """Learner rank 0's end, opened before the receivers are told anything. Default: the end is built
        at once (nothing waits for the receivers) and the receivers get `receivers_init` of it."""
        sender = self.sender(spec, metas)
        try:
            init = self.receivers_init(spec, sender)
        except BaseException:
            sender.close()
            raise
        return OpenedSender(init, lambda: sender, sender.close)

    def receivers_init(self, spec: Spec, sender: SenderEnd) -> InitInfo:
        """The init info the receivers are built from, once learner rank 0's end exists: the spec's own,
        except for a transport whose sender is made for its readers (`TransportInfo.needs_readers`), whose
        sender makes it."""
        return spec.init


class GroupScheme(TransportScheme):
    """A transport whose ends form a group at learner rank 0's host and port (gloo, nccl, shm): each end
    owns its group; a failure while building an end closes the group."""

    def init_info(self, *, receivers: int, host: str = "", port: int = 0,
                  readers: Sequence[tuple[Any, str]] = ()) -> InitInfo:
        if not host:
            raise ValueError(f"weight sync over {self.info.name}: learner rank 0's host is needed")
        return GroupInit(host, int(port))

    def group(self, spec: Spec, rank: int, store: Any = None):
        """Join the setup's group as `rank` (waits ≤ timeout for every member); rank 0 serves `store`."""
        from rayllm_rl.weight_sync.gloo_group import StatelessGlooGroup, StatelessNcclGroup

        cls = StatelessNcclGroup if self.info.gpu_only else StatelessGlooGroup
        return cls(spec.init.host, spec.init.port, rank, spec.world_size, spec.timeout_s, store=store)

    def open_sender(self, spec: Spec, metas: Sequence[TensorMeta]) -> OpenedSender:
        """Bind rank 0's store now, on a port the OS gives (`spec.init.port`, if set, is tried first); the
        receivers get the port it bound. Finishing forms the group and builds the protocol's sender."""
        from rayllm_rl.rendezvous import listen_store

        store = listen_store(spec.init.host, spec.world_size, spec.timeout_s, port=spec.init.port)
        spec = spec.with_init(dataclasses.replace(spec.init, port=int(store.port)))
        return OpenedSender(spec.init, lambda: self.sender(spec, metas, store))

    def sender(self, spec: Spec, metas: Sequence[TensorMeta], store: Any = None) -> SenderEnd:
        """Rank 0's end on the store it bound (:meth:`open_sender` gives one)."""
        if store is None:
            raise ValueError(f"weight sync over {self.info.name}: learner rank 0's end is opened first "
                             "(registry.open_sender binds its store), then finished")
        group = self.group(spec, 0, store)
        try:
            return GroupSender(self.sender_in(group, spec, metas), group)
        except BaseException:
            group.close()
            raise

    def receiver(self, spec: Spec, target: Any) -> ReceiverEnd:
        if not spec.init.port:
            raise ValueError(f"weight sync over {self.info.name}: the receivers' spec has no port; open learner "
                             "rank 0's end first (registry.open_sender) and hand the receivers "
                             "spec.with_init(opened.init)")
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
