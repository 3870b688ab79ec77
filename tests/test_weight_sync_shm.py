"""Same-node shared-memory weight transport: ShmWeightSender / ShmWeightReceiver.

The end-to-end test runs the sender in this process and two replica processes (forkserver,
as in test_weight_sync.py) that each serve the tiny model from the shared segments. The
protocol tests run their receiver on a thread of this process with a stand-in engine, which
keeps them to about a second each (2 shared cores). The sender is rank 0 of the control group here:
it binds its store (`listen_store`) before the receivers are told its port.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue as queue_mod
import threading
import time
import types
from multiprocessing import shared_memory
from typing import Mapping

import pytest
import torch

from rayllm_rl.weight_sync import (
    ShmWeightReceiver, ShmWeightSender, StatelessGlooGroup, TensorMeta, WeightSyncError, WeightSyncTimeout,
    metadata_of, plan_layout,
)
from rayllm_rl.rendezvous import listen_store

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["rayllm_rl.weight_sync", "pytest"])  # (the tests dir is not on its path)
HOST = "127.0.0.1"
PROMPT = [5, 17, 42, 9, 3]


def digest(named: Mapping[str, torch.Tensor], names) -> str:
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(named[n].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _get(q, timeout: float = 60.0):
    try:
        return q.get(timeout=timeout)
    except queue_mod.Empty:
        raise AssertionError(f"no report from the child process within {timeout}s") from None


# ---------------------------------------------------------------------------- two replica processes
def _replica_main(port, rank, world, model_path, n_syncs, q, cmd_q):
    torch.set_num_threads(1)  # 3 processes share 2 cores
    try:
        from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
        from rayllm_rl.inference.transformers.engine import TransformersEngine

        engine = TransformersEngine(model_path, seed=rank)
        group = StatelessGlooGroup(HOST, port, rank, world, timeout_s=60)
        metas, names = cmd_q.get(timeout=60)
        rx = ShmWeightReceiver(engine.weights, group, metas, names, timeout_s=60)
        for _ in range(n_syncs):
            info = rx.receive_and_swap()
            params = engine.weights.named_parameters()
            segments = sorted({rx.segment_of(p) for p in params.values()}, key=str)
            req = LLMRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=6, greedy=True, ignore_eos=True))
            resp = engine.generate([req])[0]
            with torch.no_grad():  # a full forward over prompt + answer, no KV cache
                ids = torch.tensor([PROMPT + resp.output_tokens[:-1]])
                logits = engine.model(input_ids=ids).logits[0, len(PROMPT) - 1:].float()
                full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp.output_tokens)[:, None])[:, 0]
            lp_err = (full - torch.tensor(resp.output_logprobs)).abs().max().item()
            q.put(("sync", {"rank": rank, "info": info, "version": engine.version, "segments": segments,
                            "current": rx.current_segment, "digest": digest(params, [m.name for m in metas]),
                            "lp_err": lp_err, "output_versions": resp.output_versions}))
            del params
        rx.close()
        group.close()
        q.put(("done", rank))
    except BaseException as exc:  # report instead of dying silently
        import traceback

        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


@pytest.mark.slow  # spawns processes
def test_sync_to_two_replica_processes_shares_the_segments(tiny_model_path):
    """3 syncs to 2 engine processes: weights exact, version, the params are views of segment
    k % 2, and the engine's logprobs equal a full forward over those views."""
    from transformers import AutoModelForCausalLM

    n_syncs, versions = 3, (10, 11, 12)
    store = listen_store(HOST, 3, 60)  # rank 0's, bound before the replicas are told its port
    port = store.port
    q, cmd_qs = CTX.Queue(), [CTX.Queue() for _ in range(2)]
    procs = [CTX.Process(target=_replica_main, args=(port, r, 3, tiny_model_path, n_syncs, q, cq), daemon=True)
             for r, cq in zip((1, 2), cmd_qs)]
    for p in procs:  # the replicas load their engines while the learner loads its model
        p.start()
    sender = group = None
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        base = {n: p.detach() for n, p in model.named_parameters()}
        metas = metadata_of(base)
        group = StatelessGlooGroup(HOST, port, 0, 3, timeout_s=60, store=store)
        sender = ShmWeightSender(group, metas, timeout_s=60)
        assert len(set(sender.segment_names)) == 2
        for cq in cmd_qs:
            cq.put((metas, sender.segment_names))
        expected = []
        for k, version in enumerate(versions):
            g = torch.Generator().manual_seed(100 + k)
            sent = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}
            expected.append(digest(sent, [m.name for m in metas]))
            assert sender.next_segment == k % 2
            # sync 1 comes from a lazy generator in reverse order (as an FSDP gather could)
            source = iter(list(sent.items())[::-1]) if k == 1 else sent
            stats = sender.send(source, version)
            assert (stats.version, stats.buckets, stats.bytes) == (version, 1, sum(m.nbytes for m in metas))
            del sent
        reports: dict = {1: [], 2: []}
        while any(len(v) < n_syncs for v in reports.values()):
            kind, payload = _get(q, 60)
            assert kind == "sync", payload
            reports[payload["rank"]].append(payload)
        for _ in procs:
            kind, payload = _get(q, 30)
            assert kind == "done", payload
    finally:
        if sender is not None:
            sender.close()
        if group is not None:
            group.close()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, reps in reports.items():
        for k, (r, version) in enumerate(zip(reps, versions)):
            assert r["version"] == r["info"]["version"] == version, (rank, k)
            assert r["digest"] == expected[k], f"rank {rank} sync {k}: weights differ from the sender's"
            # every parameter lives in segment k % 2: no copy, and the previous storage is gone
            assert r["segments"] == [k % 2] and r["current"] == k % 2, (rank, k, r["segments"])
            assert r["lp_err"] < 1e-4, (rank, k, r["lp_err"])
            assert set(r["output_versions"]) == {version}
            assert r["info"]["bytes"] == stats.bytes and r["info"]["stall_s"] < 1.0


# ---------------------------------------------------------------------------- protocol (thread receivers)
class _Engine:
    """Stand-in engine: the parameters are whatever swap_weights last handed over."""

    def __init__(self, metas):
        self.params = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas}
        self.version = 0

    def named_parameters(self):
        return dict(self.params)

    def swap_weights(self, back, version):
        for name in list(back):
            self.params[name], back[name] = back[name], self.params[name]
        self.version = version
        return 0.0


def _weights(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"w{i}": torch.randn(16, 9 + i, generator=g) for i in range(n)}
    out["half"] = torch.randn(13, generator=g).half()  # odd size: the next offset is realigned
    out["scalar"] = torch.tensor(2.5)
    return out


def _read_segment(name: str, metas) -> dict[str, torch.Tensor]:
    """A copy of every tensor in a segment, attached by name like any other process would."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        return {s.meta.name: torch.frombuffer(shm.buf, dtype=s.meta.dtype, count=s.meta.numel,
                                              offset=s.offset).view(s.meta.shape).clone()
                for s in plan_layout(metas).slots}
    finally:
        shm.close()


class _Peer:
    """A receiver rank on a thread: `script(rx, out)` runs once the receiver is built."""

    def __init__(self, port, metas, names_q, script, timeout_s=10.0):
        self.out: dict = {}
        self.group = None

        def run():
            try:
                self.group = StatelessGlooGroup(HOST, port, 1, 2, timeout_s=timeout_s)
                names = names_q.get(timeout=timeout_s)
                self.out["engine"] = engine = _Engine(metas)
                script(ShmWeightReceiver(engine, self.group, metas, names, timeout_s=timeout_s), self.out)
            except BaseException as exc:  # noqa: BLE001 - read by the test
                self.out["error"] = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout=15.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "receiver thread did not finish"
        if self.group is not None:
            self.group.close()


def test_sender_refuses_to_write_before_the_previous_ack():
    named = {1: _weights(1), 2: _weights(2), 3: _weights(3)}
    metas = metadata_of(named[1])
    store, names_q, got_v2 = listen_store(HOST, 2, 10), queue_mod.Queue(), threading.Event()
    port = store.port

    def script(rx, out):
        out["first"] = rx.receive_and_swap()  # version 1: swapped and acked
        out["second"] = rx.receive()  # version 2: received, never swapped, so never acked
        got_v2.set()

    peer = _Peer(port, metas, names_q, script)
    group = StatelessGlooGroup(HOST, port, 0, 2, timeout_s=10, store=store)
    sender = ShmWeightSender(group, metas, timeout_s=2.0)
    try:
        names_q.put(sender.segment_names)
        assert sender.send(named[1], 1).version == 1
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncTimeout) as ei:
            sender.send(named[2], 2)
        assert time.perf_counter() - t0 < 5
        assert ei.value.phase == "ack" and "'ack'" in str(ei.value) and "timeout 2s" in str(ei.value)
        assert got_v2.wait(5) and sender.broken
        before = [_read_segment(n, metas) for n in sender.segment_names]
        pulled = []

        def lazy():
            for item in named[3].items():
                pulled.append(item[0])
                yield item

        with pytest.raises(WeightSyncError) as ei:
            sender.send(lazy(), 3)
        assert not isinstance(ei.value, WeightSyncTimeout) and ei.value.phase == "write"
        assert "never acknowledged" in str(ei.value) and "version 2" in str(ei.value)
        assert pulled == list(named[3])  # a lazy (FSDP) source is still drained
        after = [_read_segment(n, metas) for n in sender.segment_names]
        for seg, version in ((0, 1), (1, 2)):  # nothing was overwritten
            for name, t in named[version].items():
                assert torch.equal(before[seg][name], t) and torch.equal(after[seg][name], t), (seg, name)
        engine = peer.out["engine"]
        assert engine.version == 1 and all(torch.equal(engine.params[n], t) for n, t in named[1].items())
    finally:
        sender.close()
        group.close()
        peer.join()
    assert "error" not in peer.out, peer.out.get("error")
    assert peer.out["first"]["version"] == 1 and peer.out["second"] == 2


def test_layout_mismatch_raises_on_both_sides():
    named = _weights(4)
    metas = metadata_of(named)
    wrong = list(metas)
    wrong[2] = TensorMeta(wrong[2].name, wrong[2].shape[::-1], wrong[2].dtype)  # same bytes, other shape
    assert plan_layout(wrong).nbytes == plan_layout(metas).nbytes
    assert plan_layout(wrong).fingerprint != plan_layout(metas).fingerprint
    store, names_q = listen_store(HOST, 2, 10), queue_mod.Queue()
    port = store.port

    def script(rx, out):
        try:
            rx.receive()
        except WeightSyncError as exc:
            out["rx_error"] = exc

    peer = _Peer(port, wrong, names_q, script)
    group = StatelessGlooGroup(HOST, port, 0, 2, timeout_s=10, store=store)
    sender = ShmWeightSender(group, metas, timeout_s=10)
    try:
        names_q.put(sender.segment_names)
        with pytest.raises(WeightSyncError) as ei:
            sender.send(named, 5)
        assert not isinstance(ei.value, WeightSyncTimeout)
        assert ei.value.phase == "ack" and "rank 1" in str(ei.value) and "layout" in str(ei.value)
        assert not sender.broken  # nobody swapped: the sender may go on
    finally:
        sender.close()
        group.close()
        peer.join()
    rx_err = peer.out.get("rx_error")
    assert isinstance(rx_err, WeightSyncError) and not isinstance(rx_err, WeightSyncTimeout), peer.out
    assert rx_err.phase == "header" and "layout mismatch" in str(rx_err) and "fingerprint" in str(rx_err)
    assert peer.out["engine"].version == 0


def test_segments_unlinked_on_close_and_replicas_keep_their_weights():
    named = _weights(6)
    metas = metadata_of(named)
    store, names_q = listen_store(HOST, 2, 10), queue_mod.Queue()
    port = store.port

    def script(rx, out):
        out["info"] = rx.receive_and_swap()
        out["segment"] = [rx.segment_of(t) for t in out["engine"].params.values()]
        rx.close()

    peer = _Peer(port, metas, names_q, script)
    group = StatelessGlooGroup(HOST, port, 0, 2, timeout_s=10, store=store)
    sender = ShmWeightSender(group, metas, name_prefix=f"rlws_test_{port}", timeout_s=10)
    try:
        assert sender.segment_names == (f"rlws_test_{port}_0", f"rlws_test_{port}_1")
        names_q.put(sender.segment_names)
        sender.send(named, 1)
        peer.join()
        assert "error" not in peer.out, peer.out.get("error")
        for name in sender.segment_names:  # both exist while the sender is open
            shared_memory.SharedMemory(name=name).close()
    finally:
        sender.close()
        group.close()
    for name in sender.segment_names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    stub = types.SimpleNamespace(rank=1, world_size=2)
    with pytest.raises(WeightSyncError, match="does not exist") as ei:
        ShmWeightReceiver(_Engine(metas), stub, metas, sender.segment_names)
    assert ei.value.phase == "attach"
    # The replica's parameters were views of segment 0: its mapping outlives the unlink and
    # the receiver's close, so the engine still reads version 1 (no dangling memory).
    engine = peer.out["engine"]
    assert peer.out["segment"] == [0] * len(metas) and engine.version == 1
    assert all(torch.equal(engine.params[n], t) for n, t in named.items())
