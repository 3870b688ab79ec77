"""The object-store transport between real Ray actors: learner rank 0 publishes buckets, the driver
passes references only, replicas fetch them zero-copy on this node and swap them in."""
from __future__ import annotations

import time

import pytest
import ray
import torch

from rayllm_rl.weight_sync import WeightSyncError, WeightSyncTimeout, metadata_of
from rayllm_rl.weight_sync.buckets import plan_fingerprint
from rayllm_rl.weight_sync.object_store import Handoff
from rayllm_rl.weight_sync.registry import build_receiver, make_spec, open_sender

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_importing_tests")]  # its actors run this module's classes


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(1000, 64, generator=g), "layer.0.w": torch.randn(64, 64, generator=g),
            "layer.0.b": torch.randn(64, generator=g), "norm.scale": torch.randn(64, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3)}


def big_weights(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of a few MiB, which travel in pieces (object_store.PIECE_BYTES), between small ones."""
    g = torch.Generator().manual_seed(seed)
    return {"small.a": torch.randn(3, generator=g), "big.w": torch.randn(700, 1000, generator=g),
            "odd.bf16": torch.randn(1_048_577, generator=g).to(torch.bfloat16),
            "small.b": torch.randn(5, 7, generator=g),
            "piece.exact": torch.randn(((1 << 20) - 64) // 4, generator=g)}


MAKERS = {"weights": weights, "big": big_weights}


def spec_of(named, bucket_bytes=200_000, timeout_s=5.0):
    metas = metadata_of(named)
    return make_spec("object_store", [(m.name, m.shape, str(m.dtype)[6:]) for m in metas], receivers=2,
                     timeout_s=timeout_s, bucket_bytes=bucket_bytes), metas


class Target:
    """A weight sink in the shape engines offer: names/shapes/dtypes, and a swap that adopts storage."""

    def __init__(self, named):
        self.params = {k: torch.zeros_like(v) for k, v in named.items()}
        self.version = 0

    def named_parameters(self):
        return dict(self.params)

    def swap_weights(self, back, version):
        for k, t in back.items():
            self.params[k], back[k] = t, self.params[k]
        self.version = version
        return 0.0


@ray.remote(num_cpus=0)
class Learner:
    def open(self, spec, seed, make="weights"):
        """A new sender for `spec` (what this actor published before is dropped with the old one)."""
        self.make = MAKERS[make]
        self.named = self.make(seed)
        self.sender = open_sender(spec, metadata_of(self.named)).finish()  # waits for nobody: it publishes
        return True

    def publish(self, version, seed):
        self.named = self.make(seed)
        stats, handoff = self.sender.send(iter(reversed(list(self.named.items()))), version)  # any order
        return {"bytes": stats.bytes, "buckets": stats.buckets, "handoff": handoff}


@ray.remote(num_cpus=0)
class Replica:
    def join(self, spec, rank, make="weights"):
        """A new receiver for `spec`, with a fresh sink (the views the previous one held are dropped)."""
        self.receiver = build_receiver(spec.for_rank(rank), Target(MAKERS[make](0)))
        return True

    def receive(self, published, tensors=False):
        out = self.receiver.receive_and_swap(published["handoff"])
        t = self.receiver.target
        return {"version": out["version"], "checksum": {k: float(v.double().sum()) for k, v in t.params.items()},
                "dtypes": {k: str(v.dtype) for k, v in t.params.items()}, "copied": self.receiver.copied_bytes,
                **({"tensors": {k: v.clone() for k, v in t.params.items()}} if tensors else {})}

    def held(self):
        return {k: v.clone() for k, v in self.receiver.target.params.items()}


@pytest.fixture(scope="module")
def actors(ray_importing_tests):
    """One learner and two replica actors for the module's tests: each test gives them a new sender and new
    receivers (`opened`), so it pays no actor start of its own."""
    learner, replicas = Learner.remote(), [Replica.remote() for _ in range(2)]
    yield learner, replicas
    for actor in (learner, *replicas):
        ray.kill(actor)


def opened(actors, spec, seed, make="weights", ranks=(1, 2)):
    """(learner, replicas): the module's actors with a sender for `spec` and a receiver on each rank in `ranks`."""
    learner, all_replicas = actors
    replicas = all_replicas[:len(ranks)]
    ray.get([learner.open.remote(spec, seed, make), *(r.join.remote(spec, k, make) for r, k in zip(replicas, ranks))],
            timeout=120)
    return learner, replicas


def test_two_replicas_fetch_what_the_learner_published_zero_copy(actors):
    named = weights(1)
    spec, _ = spec_of(named)
    learner, replicas = opened(actors, spec, 1)
    for version, seed in [(1, 11), (2, 12)]:
        published = learner.publish.remote(version, seed)  # the driver holds a reference, never the bytes
        outs = ray.get([r.receive.remote(published) for r in replicas], timeout=60)
        expect = weights(seed)
        info = ray.get(published, timeout=30)
        assert info["bytes"] == sum(t.numel() * t.element_size() for t in expect.values())
        # 200 kB buckets: the 256 kB embedding alone, then the float32 layer, the bf16 norm, the empty tensor
        assert info["buckets"] == len(info["handoff"].refs) == 4
        for out in outs:
            assert out["version"] == version
            assert out["checksum"] == {k: float(v.double().sum()) for k, v in expect.items()}
            assert out["dtypes"]["norm.scale"] == "torch.bfloat16"
            assert out["copied"] == 0  # every tensor is a read-only view of the shared store: no copy


def test_tensors_of_a_few_mib_travel_in_pieces_and_arrive_as_one_zero_copy_view(actors):
    """big.w (2.8 MB) and odd.bf16 (2,097,154 bytes) go as 3 pieces each, piece.exact as one: 5 + 2 + 1
    buffers; each replica sees every tensor whole, equal to what was sent, over the store's memory."""
    from rayllm_rl.weight_sync.object_store import PIECE_BYTES, pieces_of

    named = big_weights(1)
    assert [pieces_of(t.numel() * t.element_size()) for t in named.values()] == [1, 3, 3, 1, 1]
    assert named["piece.exact"].numel() * 4 == PIECE_BYTES
    spec, _ = spec_of(named, bucket_bytes=64 << 20)
    learner, replicas = opened(actors, spec, 1, "big")
    published = learner.publish.remote(1, 21)
    for version, seed in [(1, 21), (2, 22)]:
        outs = ray.get([r.receive.remote(published, True) for r in replicas], timeout=60)
        expect = big_weights(seed)
        assert ray.get(published, timeout=30)["buckets"] == 3  # buckets hold one dtype: f32, bf16, f32
        for out in outs:
            assert out["version"] == version and out["copied"] == 0
            for k, v in expect.items():
                assert torch.equal(out["tensors"][k], v), k
        # The next version is published and this one's references dropped by the learner and the driver:
        # the views the replicas swapped in keep this version's object alive, values unchanged.
        del published, outs
        published = learner.publish.remote(version + 1, seed + 1)
        ray.get(published, timeout=30)
        held = ray.get([r.held.remote() for r in replicas], timeout=60)
        for tensors in held:
            for k, v in expect.items():
                assert torch.equal(tensors[k], v), k


def test_a_replica_that_joins_later_fetches_the_kept_handoff(actors):
    """A restarted replica gets the current weights from the last handoff (the learner keeps it)."""
    named = weights(2)
    spec, _ = spec_of(named)
    learner, (first,) = opened(actors, spec, 2, ranks=(1,))
    published = learner.publish.remote(7, 21)
    ray.get(first.receive.remote(published), timeout=60)
    late = actors[1][1]
    assert ray.get(late.join.remote(spec, 2), timeout=60)  # its receiver built after the sync
    out = ray.get(late.receive.remote(published), timeout=60)
    assert out["version"] == 7 and out["checksum"]["layer.0.w"] == float(weights(21)["layer.0.w"].double().sum())


def test_a_fetch_that_never_completes_times_out_naming_its_phase():
    named = weights(3)
    spec, metas = spec_of(named, bucket_bytes=1 << 30, timeout_s=1.0)
    receiver = build_receiver(spec.for_rank(1), Target(named))

    @ray.remote(num_cpus=0)
    def never():
        time.sleep(60)

    ref = never.remote()
    buckets = receiver.buckets  # a handoff of the receiver's own plan, whose objects never arrive
    handoff = Handoff(3, plan_fingerprint(buckets), (ref,) * len(buckets), 0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout,
                       match=rf"phase 'fetch bucket 1/{len(buckets)}' timed out on rank 1 .*timeout 1s"):
        receiver.receive(handoff)
    assert time.monotonic() - t0 < 10
    ray.cancel(ref, force=True)


def test_a_handoff_of_another_plan_is_refused_before_any_fetch():
    named = weights(4)
    spec, metas = spec_of(named)
    receiver = build_receiver(spec.for_rank(1), Target(named))
    other, _ = spec_of(named, bucket_bytes=1 << 30)
    sender = open_sender(other, metas).finish()
    _, handoff = sender.send(named, 1)
    with pytest.raises(WeightSyncError, match=r"phase 'handoff'.*same metas and bucket_bytes"):
        receiver.receive(handoff)


def test_a_sender_given_a_wrong_tensor_names_it_and_publishes_nothing():
    named = weights(5)
    spec, metas = spec_of(named)
    sender = open_sender(spec, metas).finish()
    bad = {**named, "layer.0.w": torch.zeros(3, 3)}
    with pytest.raises(WeightSyncError, match=r"layer.0.w is \(3, 3\)/torch.float32, planned \(64, 64\)"):
        sender.send(bad, 1)
    missing = {k: v for k, v in named.items() if k != "layer.0.b"}
    with pytest.raises(WeightSyncError, match="layer.0.b"):
        sender.send(missing, 1)
    assert sender.handoff is None


@ray.remote(num_cpus=0)
class NeverPublishes:
    def send_weights(self, version):
        time.sleep(60)


def test_a_replica_awaits_the_handoff_reference_and_times_out_naming_the_phase(tiny_model_path):
    """The driver passes `[reference]` to rank 0's result (cluster.handoff_arg), so the replica's call runs
    while rank 0 publishes; a rank 0 that never publishes fails the replica's receive after
    ray.sync_timeout_s, naming the phase, and the replica still holds version 0."""
    from transformers import AutoModelForCausalLM

    from rayllm_rl.inference.registry import EngineSpec
    from rayllm_rl.orchestration.ray.actors import InferenceReplica
    from rayllm_rl.orchestration.ray.cluster import handoff_arg
    from rayllm_rl.weight_sync.registry import transport_info

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    spec, _ = spec_of(dict(model.named_parameters()), timeout_s=1.0)
    replica = InferenceReplica.remote(EngineSpec("transformers", tiny_model_path))
    assert ray.get(replica.init_update_group.remote(spec.for_rank(1)), timeout=120)
    stuck = NeverPublishes.remote().send_weights.remote(1)
    arg = handoff_arg(transport_info("object_store"), stuck)
    assert isinstance(arg, list) and arg[0] is stuck
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError,
                       match=r"did not publish within ray.sync_timeout_s=1s \(phase: handoff\)"):
        ray.get(replica.receive_weights.remote(arg), timeout=60)
    assert time.monotonic() - t0 < 30
    assert ray.get(replica.version_history.remote(), timeout=30) == [0]  # nothing was swapped in
    ray.kill(replica, no_restart=True)
