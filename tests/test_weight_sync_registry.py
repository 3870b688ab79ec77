"""The transport registry: the one place that plans a transport from the placement and builds both ends."""
from __future__ import annotations

import pytest

from rayllm_rl.weight_sync.registry import TRANSPORTS, SyncSpec, make_spec, plan_transport, scheme_of, transport_info
from rayllm_rl.weight_sync.scheme import GroupInit, NoInit, ShmInit

METAS = (("embed.weight", (10, 4), "float32"), ("norm.weight", (4,), "bfloat16"))


@pytest.mark.parametrize("learner_gpus,replica_gpus,nodes,expect", [
    (False, False, {"a"}, "object_store"),  # CPU, one node: zero-copy through the node's store
    (False, False, {"a", "b"}, "object_store"),  # across nodes: Ray's own transfer
    (True, True, {"a"}, "nccl"),
    (True, False, {"a"}, "object_store"),  # a CPU side: through host memory
])
def test_auto_follows_the_placement(learner_gpus, replica_gpus, nodes, expect):
    got = plan_transport("auto", learner_gpus=learner_gpus, replica_gpus=replica_gpus, learner_node="a",
                         replica_nodes=nodes)
    assert got == expect


def test_a_transport_that_cannot_serve_the_placement_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"ray.sync_transport=shm needs every replica on the learner's node"):
        plan_transport("shm", learner_gpus=False, replica_gpus=False, learner_node="a", replica_nodes={"a", "b"})
    with pytest.raises(ValueError, match=r"ray.sync_transport=nccl needs GPUs on both sides"):
        plan_transport("nccl", learner_gpus=True, replica_gpus=False, learner_node="a", replica_nodes={"a"})
    with pytest.raises(ValueError, match=r"unknown weight-sync transport 'tcp'"):
        plan_transport("tcp", learner_gpus=False, replica_gpus=False, learner_node="a", replica_nodes={"a"})
    assert plan_transport("gloo", learner_gpus=False, replica_gpus=False, learner_node="a",
                          replica_nodes={"a", "b"}) == "gloo"
    with pytest.raises(ValueError, match=r"ray.sync_transport=rdt_gloo initialises the learner's torch.distributed.*"
                                         r"ray.num_learners=2"):
        plan_transport("rdt_gloo", learner_gpus=False, replica_gpus=False, learner_node="a", replica_nodes={"b"},
                       learner_ranks=2)
    with pytest.raises(ValueError, match=r"ray.sync_transport=rdt_nccl needs GPUs on both sides"):
        plan_transport("rdt_nccl", learner_gpus=False, replica_gpus=False, learner_node="a", replica_nodes={"a"})


def test_spec_init_per_transport_and_rank_offsets():
    """Each receiving process has a rank of its own: a replica with 2 tensor-parallel workers
    (both receiving) takes ranks k and k+1, the next replica starts after them."""
    ranks = [2, 2, 1]  # receiving processes per replica
    spec = make_spec("gloo", METAS, receivers=sum(ranks), timeout_s=7, bucket_bytes=1 << 20, host="10.0.0.1", port=1234)
    assert spec.world_size == 6 and spec.init == GroupInit("10.0.0.1", 1234)
    first = [1 + sum(ranks[:i]) for i in range(len(ranks))]
    worker_ranks = [spec.for_rank(f).rank + tp for f, n in zip(first, ranks) for tp in range(n)]
    assert worker_ranks == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"receiver rank 6 is outside \[1, 6\)"):
        spec.for_rank(6)
    shm = make_spec("shm", METAS, receivers=1, timeout_s=7, bucket_bytes=1, host="h", port=1)
    assert isinstance(shm.init, ShmInit) and (shm.init.host, shm.init.port) == ("h", 1)
    seg0, seg1 = shm.init.segments
    assert seg0.endswith("_0") and seg1.endswith("_1") and seg0[:-2] == seg1[:-2]
    store = make_spec("object_store", METAS, receivers=3, timeout_s=7, bucket_bytes=1)
    assert store.init == NoInit() and store.info.pulls and store.info.receiver_needs_ray
    with pytest.raises(ValueError, match="learner rank 0's host is needed"):
        make_spec("gloo", METAS, receivers=1, timeout_s=7, bucket_bytes=1)
    # no port is picked ahead: rank 0 binds one the OS gives when it opens its end (a port given is tried first)
    assert make_spec("gloo", METAS, receivers=1, timeout_s=7, host="h").init == GroupInit("h", 0)


def test_bucket_size_zero_is_the_transports_own_default():
    """The object store puts a bucket as one Ray object (about a millisecond each), so its default is
    256 MiB; group transports pack 16 MiB flat buffers. An explicit size wins; a negative one is refused."""
    assert make_spec("object_store", METAS, receivers=1, timeout_s=7).bucket_bytes == 256 << 20
    assert make_spec("gloo", METAS, receivers=1, timeout_s=7, host="h", port=1).bucket_bytes == 16 << 20
    assert make_spec("object_store", METAS, receivers=1, timeout_s=7, bucket_bytes=1 << 20).bucket_bytes == 1 << 20
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        make_spec("object_store", METAS, receivers=1, timeout_s=7, bucket_bytes=-1)


def test_spec_crosses_into_vllms_worker_as_plain_fields():
    spec = make_spec("gloo", METAS, receivers=2, timeout_s=7, bucket_bytes=99, host="h", port=5).for_rank(2)
    d = spec.as_dict()
    assert all(isinstance(v, (str, int, float, tuple, list, dict)) for v in d.values())
    d["metas"] = [[n, list(s), dt] for n, s, dt in d["metas"]]  # what a msgpack round trip gives back
    assert SyncSpec.from_dict(d) == spec
    shm = make_spec("shm", METAS, receivers=1, timeout_s=7, host="h", port=5)
    d = shm.as_dict()
    assert d["init"]["kind"] == "ShmInit"
    d["init"]["segments"] = list(d["init"]["segments"])  # msgpack gives lists back
    assert SyncSpec.from_dict(d) == shm


def test_every_transport_is_described_by_properties_engines_may_ask():
    # one line per transport, its scheme on it: each builds, with the transport's own properties
    from rayllm_rl.weight_sync.scheme import TransportScheme

    assert all(isinstance(scheme_of(n), TransportScheme) and scheme_of(n).info is t for n, t in TRANSPORTS.items())
    assert set(TRANSPORTS) == {"object_store", "ray_channel", "rdt_gloo", "rdt_nccl", "shm", "gloo", "nccl", "cuda_ipc"}
    assert [n for n, t in TRANSPORTS.items() if t.pulls] == ["object_store", "rdt_gloo", "rdt_nccl", "cuda_ipc"]
    assert {n: t.tensor_transport for n, t in TRANSPORTS.items() if t.tensor_transport} == {"rdt_gloo": "gloo",
                                                                                          "rdt_nccl": "nccl"}
    assert [n for n, t in TRANSPORTS.items() if not t.cross_node] == ["ray_channel", "shm", "cuda_ipc"]
    assert [n for n, t in TRANSPORTS.items() if t.needs_readers] == ["ray_channel"]  # the driver names its readers
    assert transport_info("nccl").gpu_only and not transport_info("gloo").gpu_only


def test_a_vllm_replica_takes_a_rank_per_worker_only_where_its_workers_receive(tiny_model_path):
    """vLLM's workers join a group transport themselves (one rank each); for the object store the
    replica actor receives for them (one rank). Built without starting vLLM, and without the vllm package: it passes
    with vllm hidden (its own importorskip("vllm") skipped it for nothing where vllm is missing)."""
    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.inference.vllm.engine import VLLMEngine

    engine = VLLMEngine(tiny_model_path, tensor_parallel_size=2)
    assert {t: engine.weights.receiving_processes(t) for t in TRANSPORTS} == {
        "object_store": 1, "ray_channel": 1, "rdt_gloo": 1, "rdt_nccl": 1, "shm": 2, "gloo": 2, "nccl": 2,
        "cuda_ipc": 2}
    assert {TransformersEngine(tiny_model_path).weights.receiving_processes(t) for t in TRANSPORTS} == {1}


def test_ray_direct_ends_check_what_ray_delivered():
    """The RDT ends call no Ray: the sender returns its tensors, the receiver checks what arrived."""
    import torch

    from rayllm_rl.weight_sync import metadata_of
    from rayllm_rl.weight_sync.registry import build_receiver, open_sender

    named = {"embed.weight": torch.randn(10, 4), "norm.weight": torch.randn(4).to(torch.bfloat16)}
    metas = metadata_of(named)
    spec = make_spec("rdt_gloo", [(m.name, m.shape, str(m.dtype)[6:]) for m in metas], receivers=1, timeout_s=5,
                     bucket_bytes=1 << 20)

    class Target:
        params = {k: torch.zeros_like(v) for k, v in named.items()}

        def named_parameters(self):
            return dict(self.params)

        def swap_weights(self, back, version):
            self.params.update(back)
            return 0.0

    opened, target = open_sender(spec, metas), Target()
    sender = opened.finish()  # nothing to wait for: the receiver gets the tensors in the handoff
    receiver = build_receiver(spec.with_init(opened.init).for_rank(1), target)
    stats, handoff = sender.send(reversed(list(named.items())), 4)  # any order
    assert stats.bytes == 10 * 4 * 4 + 4 * 2 and handoff["tensors"]["embed.weight"].data_ptr() == \
        named["embed.weight"].data_ptr()  # no copy on the sender: Ray sends the tensor itself
    assert receiver.receive_and_swap(handoff)["version"] == 4
    assert all(torch.equal(target.params[k], v) for k, v in named.items())
    with pytest.raises(Exception, match=r"phase 'handoff'.*norm.weight: got None"):
        receiver.receive({**handoff, "tensors": {"embed.weight": named["embed.weight"]}})
    with pytest.raises(Exception, match=r"phase 'publish'.*norm.weight"):
        sender.send({"embed.weight": named["embed.weight"]}, 5)


def test_a_group_receiver_never_writes_storage_another_transport_handed_the_engine(tiny_model_path, tmp_path):
    """An engine whose weights are read-only views (the object store's, a shm segment's) then syncs over
    gloo twice: the second receive must not land in the views the first swap handed back (writing a
    read-only mapping kills the process)."""
    import mmap
    import threading

    import torch

    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.weight_sync import metadata_of
    from rayllm_rl.weight_sync.registry import build_receiver
    from weight_sync_helpers import OpenedInBackground

    engine = TransformersEngine(tiny_model_path)
    params = engine.weights.named_parameters()
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in params.values()))
    with open(blob, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # read-only, as the store's views are
    views, off = {}, 0
    for name, p in params.items():
        views[name] = torch.frombuffer(view, dtype=p.dtype, count=p.numel(), offset=off).view(p.shape)
        off += p.numel() * p.element_size()
    engine.weights.swap_weights(views, 1)
    metas = metadata_of(params)
    spec = make_spec("gloo", [(m.name, m.shape, str(m.dtype)[6:]) for m in metas], receivers=1, timeout_s=30,
                     bucket_bytes=1 << 20, host="127.0.0.1")
    rank0 = OpenedInBackground(spec, metas)  # binds its store; finishes while the receiver joins
    receiver = build_receiver(rank0.spec.for_rank(1), engine.weights)
    box = {"sender": rank0.sender(30)}
    for version in (2, 3):
        new = {k: torch.full(v.shape, float(version)) for k, v in params.items()}
        send = threading.Thread(target=lambda: box.__setitem__("sent", box["sender"].send(new, version)))
        send.start()
        assert receiver.receive_and_swap()["version"] == version
        send.join(30)
        assert all(torch.equal(engine.weights.named_parameters()[k], v) for k, v in new.items())
    receiver.close()
    box["sender"].close()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_group_forms_although_the_port_it_was_asked_to_try_is_taken(transport):
    """A port another process holds (the race a port picked ahead and bound later loses): learner rank 0's
    store tries it, falls back to one the OS gives, and the receiver, told the port rank 0 bound, joins the
    group; the weights then arrive exactly."""
    import socket
    import threading

    import torch

    from rayllm_rl.weight_sync import metadata_of
    from rayllm_rl.weight_sync.registry import build_receiver, open_sender

    g = torch.Generator().manual_seed(3)
    named = {"embed.weight": torch.randn(40, 16, generator=g), "norm.weight": torch.randn(16, generator=g).bfloat16(),
             "lm_head.weight": torch.randn(40, 16, generator=g)}
    metas = metadata_of(named)

    class Target:
        def __init__(self):
            self.params = {k: torch.zeros_like(v) for k, v in named.items()}

        def named_parameters(self):
            return dict(self.params)

        def swap_weights(self, back, version):
            for k, t in back.items():
                self.params[k], back[k] = t, self.params[k]
            return 0.0

    def in_thread(fn, box, key):
        def run():
            try:
                box[key] = fn()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                box[f"{key}_error"] = exc

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th

    def joined(th, box, key, timeout_s=30):
        th.join(timeout_s)
        assert not th.is_alive(), f"{key}: not done within {timeout_s}s"
        assert f"{key}_error" not in box, box[f"{key}_error"]
        return box[key]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = make_spec(transport, [(m.name, m.shape, str(m.dtype)[6:]) for m in metas], receivers=1, timeout_s=30,
                         bucket_bytes=1 << 10, host="127.0.0.1", port=port)
        opened = open_sender(spec, metas)
        sender = receiver = None
        try:
            assert opened.init.port != port and opened.init.port > 0, (opened.init, port)
            target, box = Target(), {}
            joining = in_thread(lambda: build_receiver(spec.with_init(opened.init).for_rank(1), target), box,
                                "receiver")
            sender = opened.finish()  # waits (<= 30 s) for the receiver to join the port rank 0 bound
            receiver = joined(joining, box, "receiver")
            receiving = in_thread(receiver.receive_and_swap, box, "got")
            stats, _ = sender.send(named, 5)  # a push transport: the receiver takes it in the collective
            assert joined(receiving, box, "got")["version"] == 5 and stats.version == 5
            assert stats.bytes == sum(m.nbytes for m in metas)
            for k, v in named.items():
                assert target.params[k].dtype == v.dtype and torch.equal(target.params[k], v), k
        finally:
            opened.close()  # (a no-op once finished)
            if receiver is not None:
                receiver.close()
            if sender is not None:
                sender.close()
