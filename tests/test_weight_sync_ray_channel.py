"""The Ray-channel transport between real Ray actors: learner rank 0 writes each version into one of two
mutable store objects in turn, replicas read it in place and swap it in; Ray holds a write back until
every replica has dropped that channel's previous version."""
from __future__ import annotations

import time

import pytest
import ray
import torch

from rayllm_rl.weight_sync import WeightSyncError, WeightSyncTimeout, metadata_of
from rayllm_rl.weight_sync.registry import build_receiver, make_spec, open_sender, plan_transport

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_importing_tests")]  # its actors run this module's classes


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Float32 tensors, one of a few MiB (it travels in pieces), a bf16 one and an empty one."""
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(1000, 64, generator=g), "big.w": torch.randn(700, 1000, generator=g),
            "layer.0.b": torch.randn(64, generator=g), "norm.scale": torch.randn(64, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3)}


def metas_spec(named):
    return [(m.name, m.shape, str(m.dtype)[6:]) for m in metadata_of(named)]


class Target:
    """A weight sink in the shape engines offer; `keep_old` makes it keep every version it swapped out
    (an engine that never lets go of old weights: the failure a write must not overrun)."""

    def __init__(self, named, keep_old=False):
        self.params = {k: torch.zeros_like(v) for k, v in named.items()}
        self.kept, self.keep_old = [], keep_old

    def named_parameters(self):
        return dict(self.params)

    def swap_weights(self, back, version):
        for k, t in back.items():
            self.params[k], back[k] = t, self.params[k]
        if self.keep_old:
            self.kept.append(dict(back))
        return 0.0


@ray.remote(num_cpus=0)
class Learner:
    sender = None

    def open(self, readers, timeout_s):
        """A new pair of channels to `readers` (the previous pair, if any, closed first)."""
        if self.sender is not None:
            self.sender.close()
        self.named = weights(0)
        spec = make_spec("ray_channel", metas_spec(self.named), receivers=len(readers), timeout_s=timeout_s,
                         readers=readers)
        opened = open_sender(spec, metadata_of(self.named))  # the writer makes the channels its readers attach
        self.sender = opened.finish()
        return spec.with_init(opened.init)

    def send(self, version, seed):
        self.named = weights(seed)
        stats, handoff = self.sender.send(iter(reversed(list(self.named.items()))), version)  # any order
        return {"bytes": stats.bytes, "version": stats.version, "handoff": handoff}

    def close(self):
        self.sender.close()
        return True


@ray.remote(num_cpus=0)
class Replica:
    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    receiver = None

    def join(self, spec, rank, keep_old=False):
        """Attach to a new pair of channels, with a fresh sink (what the previous test's sink held is dropped)."""
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = build_receiver(spec.for_rank(rank), Target(weights(0), keep_old))
        return True

    def receive(self, timeout_s=None):
        out = self.receiver.receive_and_swap(header_timeout_s=timeout_s)
        params = self.receiver.target.params
        return {"version": out["version"], "copied": self.receiver.copied_bytes,
                # memory torch did not allocate (a numpy view of the store's), not a copy
                "borrowed": all(not t.untyped_storage().resizable() for t in params.values() if t.numel()),
                "tensors": {k: v.clone() for k, v in params.items()}}

    def receive_error(self, timeout_s=None):
        t0 = time.monotonic()
        try:
            self.receiver.receive(header_timeout_s=timeout_s)
        except WeightSyncError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return None

    def held(self):
        return {k: v.clone() for k, v in self.receiver.target.params.items()}


@pytest.fixture(scope="module")
def actors(ray_importing_tests):
    """One learner and two replica actors for the module: each test opens a new pair of channels between them
    (`setup`), so it pays no actor start of its own."""
    replicas = [Replica.remote() for _ in range(2)]
    learner = Learner.remote()
    ray.get([learner.__ray_ready__.remote(), *(r.__ray_ready__.remote() for r in replicas)], timeout=120)
    yield learner, replicas
    for actor in (learner, *replicas):
        ray.kill(actor)


@pytest.fixture
def setup(actors):
    """setup(n, timeout_s, keep_old) -> (learner, the first n replicas), joined to a new pair of channels."""
    learner, all_replicas = actors

    def open_channels(n=2, timeout_s=10.0, keep_old=False):
        replicas = all_replicas[:n]
        readers = list(zip(replicas, ray.get([r.node_id.remote() for r in replicas], timeout=60)))
        spec = ray.get(learner.open.remote(readers, timeout_s), timeout=60)
        ray.get([r.join.remote(spec, 1 + i, keep_old) for i, r in enumerate(replicas)], timeout=60)
        return learner, replicas

    return open_channels


def test_two_replicas_read_every_version_in_place(setup):
    learner, replicas = setup()
    nbytes = sum(t.numel() * t.element_size() for t in weights(0).values())
    for version in range(1, 5):  # both channels, twice each
        sent = learner.send.remote(version, 10 + version)  # the driver passes versions, never bytes
        outs = ray.get([r.receive.remote() for r in replicas], timeout=60)
        info = ray.get(sent, timeout=60)
        assert info["bytes"] == nbytes and info["version"] == version and info["handoff"] is None
        expect = weights(10 + version)
        for out in outs:
            assert out["version"] == version
            assert out["copied"] == 0 and out["borrowed"]  # views of the store's memory: no copy
            for k, v in expect.items():
                assert torch.equal(out["tensors"][k], v) and out["tensors"][k].dtype == v.dtype, k


def test_a_write_waits_for_the_replicas_to_let_go_of_that_channel(setup):
    """Version 2 goes to the other channel while the replicas decode with version 1; version 3 would
    overwrite version 1's channel, so it waits: here the replicas never read version 2, and the write
    times out naming its phase, while the replicas' version-1 weights stay as sent."""
    learner, replicas = setup(timeout_s=1.5)
    ray.get(learner.send.remote(1, 21), timeout=60)
    ray.get([r.receive.remote() for r in replicas], timeout=60)
    ray.get(learner.send.remote(2, 22), timeout=60)  # channel 1: free
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(learner.send.remote(3, 23), timeout=60)
    assert time.monotonic() - t0 < 15
    assert isinstance(err.value.cause, WeightSyncTimeout)
    assert "phase 'write channel 0' timed out on rank 0" in str(err.value.cause)
    assert "a replica still holds what this channel carried two versions ago" in str(err.value.cause)
    for held in ray.get([r.held.remote() for r in replicas], timeout=60):
        for k, v in weights(21).items():
            assert torch.equal(held[k], v), k
    with pytest.raises(ray.exceptions.RayTaskError, match=r"an earlier write failed .*form the group again"):
        ray.get(learner.send.remote(4, 24), timeout=60)


def test_an_engine_that_keeps_old_weights_stalls_the_writer_not_its_memory(setup):
    """A sink that keeps every swapped-out version holds channel 0's views past the next swap: the
    third write is refused (timeout) instead of overwriting memory the engine may still read."""
    learner, (replica,) = setup(n=1, timeout_s=1.5, keep_old=True)
    for version in (1, 2):
        ray.get(learner.send.remote(version, 30 + version), timeout=60)
        ray.get(replica.receive.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match=r"phase 'write channel 0' timed out"):
        ray.get(learner.send.remote(3, 33), timeout=60)


def test_a_read_with_nothing_written_times_out_naming_its_phase(setup):
    _, (replica,) = setup(n=1)
    name, message, waited = ray.get(replica.receive_error.remote(1.0), timeout=60)
    assert name == "WeightSyncTimeout" and waited < 10
    assert "phase 'read channel 0' timed out on rank 1" in message and "learner rank 0 wrote no version" in message


def test_closing_the_sender_ends_a_waiting_read_before_its_timeout(setup):
    learner, (replica,) = setup(n=1, timeout_s=60.0)
    waiting = replica.receive_error.remote(60.0)
    time.sleep(1.0)
    ray.get(learner.close.remote(), timeout=30)
    name, message, waited = ray.get(waiting, timeout=60)
    assert name == "WeightSyncError" and waited < 30
    assert "phase 'read channel 0' failed on rank 1" in message


def test_setups_that_cannot_work_are_refused_naming_the_problem(actors):
    named = weights(0)
    spec_metas = metas_spec(named)
    with pytest.raises(ValueError, match=r"2 receiving processes but 1 readers"):
        make_spec("ray_channel", spec_metas, receivers=2, timeout_s=5, readers=[(None, "n")])
    stand_in = actors[1][0]  # a replica actor, as the reader's handle
    far = make_spec("ray_channel", spec_metas, receivers=1, timeout_s=5, readers=[(stand_in, "f" * 56)])
    with pytest.raises(ValueError, match=r"readers on nodes \['f{56}'\].*use object_store across nodes"):
        open_sender(far, metadata_of(named))
    here = ray.get(stand_in.node_id.remote(), timeout=60)
    spec = make_spec("ray_channel", spec_metas, receivers=1, timeout_s=5, readers=[(stand_in, here)])
    with pytest.raises(ValueError, match=r"the spec has no channels; build learner rank 0's end first"):
        build_receiver(spec.for_rank(1), Target(named))
    with pytest.raises(ValueError, match=r"ray.sync_transport=ray_channel needs every replica on the learner's node"):
        plan_transport("ray_channel", learner_gpus=False, replica_gpus=False, learner_node="a", replica_nodes=["b"])
    opened = open_sender(spec, metadata_of(named))
    sender = opened.finish()
    try:
        receiver = build_receiver(spec.with_init(opened.init).for_rank(1), Target(named))
        with pytest.raises(WeightSyncError, match=r"phase 'read channel 0'.*got a handoff"):
            receiver.receive(object())
    finally:
        sender.close()
