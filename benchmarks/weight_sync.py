"""Weight sync learner -> replicas over every CPU transport of the registry, in one Ray run.

Ray's object store (`object_store`), Ray's mutable-object channels (`ray_channel`), Ray Direct Transport
over gloo (`rdt_gloo`), the shared-memory double buffer (`shm`) and gloo buckets (`gloo`) side by side,
each built by `weight_sync.registry` as a job builds them (rdt_*: a Ray collective group of the sender
and the replicas, as `cluster.join_collective_group` makes it; ray_channel: the sender's end first, its
channels then handed to the replicas, as `cluster.form_sync_group` does):

* sender: a benchmark-local actor standing in for learner rank 0, one per group. It holds the
  model's weights (`from_pretrained`), perturbs them before every sync (so each version has its own
  checksum; not timed) and sends through the registry's `open_sender` end (opened first: a group binds
  its store there, on a port the OS gives; finished while the replicas join).
* receivers: the job's own `InferenceReplica` actors. Transformers: `--replicas` (2) per transport,
  each set in its own group for the whole run, as in a job, where a replica never changes transport
  (a Transformers replica fed by shm or the object store holds read-only views, and gloo's double
  buffer would later receive into them). vLLM ("into vLLM"): one replica; each block forms that
  transport's group, runs one untimed warm-up sync, times its syncs and leaves the group.
  The driver passes learner rank 0's result reference to the replicas as `Cluster.sync_weights`
  does (a pull transport's receivers get it; push transports receive in the group collective at
  the same time), so it never holds bytes.
* load: in the "generating" phase a helper actor keeps `--concurrency` `agenerate` requests in
  flight on each replica being synced (Transformers: from `--warmup-s` before a block's first sync
  to its end; vLLM: the whole phase, group forming included).

Transports interleave round by round (`--repeats` rounds, `--syncs` timed syncs per transport a
round), so the machine's noise hits all of them alike. After every sync each replica's checksum
must equal the sender's. Timed per sync: end to end as the driver sees it (first sender call ->
every replica swapped), the sender's send (object store: the puts; shm: write + header + waiting
for every ack, which comes after the swap), each replica's receive (object store: the fetch) and
stall (time generation was held). The bandwidth yardstick is memcpy of the same tensors in the
sender's process, sampled before every block (median of the idle blocks). Bytes/s = model bytes / end-to-end
seconds (every replica got all of them).

Targets (issue L), checked for the Ray paths: >= 0.9x shm end to end while generating; idle >= 50%
of memcpy; stall <= 5% of the sync time.

    .venv/bin/python benchmarks/weight_sync.py [--repeats 4] [--syncs 2] [--hidden-size 512 --layers 8]
        [--transports object_store,shm,gloo] [--no-vllm]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402
from ray.experimental.collective import create_collective_group, destroy_collective_group  # noqa: E402

from rayllm_rl.orchestration.ray.cluster import handoff_arg  # noqa: E402
from rayllm_rl.orchestration.ray.session import LOCAL_SYSTEM_CONFIG  # noqa: E402
from rayllm_rl.weight_sync.registry import TRANSPORTS, make_spec, transport_info  # noqa: E402

TARGETS = {"object_store_vs_shm_generating": 0.9, "object_store_idle_vs_memcpy": 0.5, "stall_fraction_of_sync": 0.05}
CHECKSUM_RTOL = 1e-9
"""Checksums are float64 sums over the same float32 tensors; only the summation order may differ."""


@ray.remote(num_cpus=0, enable_tensor_transport=True)  # rdt_* transports: Ray sends this actor's results' tensors
class Sender:
    """Learner rank 0's sending ends (one per group) over a model's weights; perturbs them per version."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.named = {k: v.detach() for k, v in model.named_parameters()}  # what a learner sends
        self.ends: dict[str, object] = {}
        self.opened: dict[str, object] = {}  # ends opened and not yet finished
        self.stats: dict[str, dict] = {}

    def metas(self) -> tuple:
        from rayllm_rl.weight_sync import metadata_of, metas_to_spec

        return metas_to_spec(metadata_of(self.named))

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def open(self, key: str, spec):
        """Open the sending end of group `key` (a group transport binds its store here, on a port the OS
        gives); returns the receivers' init info (that port; Ray channels: what it made), as
        `LearnerWorker.open_weight_sender`."""
        from rayllm_rl.weight_sync import metadata_of
        from rayllm_rl.weight_sync.registry import open_sender

        self.close(key)
        self.opened[key] = open_sender(spec, metadata_of(self.named))
        return self.opened[key].init

    def finish(self, key: str) -> bool:
        """Complete the end `open` opened (a group transport waits here for every receiver), as
        `LearnerWorker.finish_weight_sender`: the driver calls it while the replicas join."""
        self.ends[key] = self.opened.pop(key).finish()
        return True

    def size(self) -> tuple[int, int]:
        """(parameters, bytes) of what a sync carries."""
        return (sum(t.numel() for t in self.named.values()),
                sum(t.numel() * t.element_size() for t in self.named.values()))

    def memcpy(self) -> float:
        """Seconds to copy every tensor into preallocated ones (first touch untimed): the yardstick,
        measured in the sender's process, between the syncs, so noise hits it as it hits them."""
        if not hasattr(self, "dst"):
            self.dst = {k: v.clone() for k, v in self.named.items()}
        t0 = time.perf_counter()
        for k, v in self.named.items():
            self.dst[k].copy_(v)
        return time.perf_counter() - t0

    def perturb(self, version: int) -> float:
        """New weights for `version` (every tensor changes); returns their checksum."""
        from rayllm_rl.inference.protocol import weights_checksum

        with torch.no_grad():
            for i, t in enumerate(self.named.values()):
                t.add_(1e-4 * (1 + (version + i) % 7))
        return weights_checksum(self.named)

    def send(self, key: str, version: int) -> dict:
        """What `LearnerWorker.send_weights` returns: the handoff (references, tensors Ray moves, or None)."""
        stats, handoff = self.ends[key].send(self.named, version)
        self.stats[key] = {"send_s": stats.seconds, "bytes": stats.bytes}
        return {"handoff": handoff}

    def last_stats(self, key: str) -> dict:
        """The last send's seconds and bytes (a Ray Direct Transport result cannot be fetched by the driver)."""
        return self.stats[key]

    def close(self, key: str | None = None) -> None:
        for k in [key] if key is not None else list({*self.ends, *self.opened}):
            opened = self.opened.pop(k, None)
            if opened is not None:
                opened.close()
            end = self.ends.pop(k, None)
            if end is not None:
                end.close()


@ray.remote(num_cpus=0)
class Load:
    """Keeps `concurrency` requests in flight on each replica until stopped; records each one."""

    def __init__(self, replicas: list, prompt_ids: list[int], max_new_tokens: int, concurrency: int):
        self.replicas, self.prompt, self.max_new, self.concurrency = replicas, prompt_ids, max_new_tokens, concurrency
        self.tasks: list[asyncio.Task] = []
        self.records: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.running = False

    async def _loop(self, replica) -> None:
        from rayllm_rl.inference.protocol import LLMRequest, SamplingParams

        sampling = SamplingParams(max_new_tokens=self.max_new, ignore_eos=True)
        while self.running:
            t0 = time.time()
            try:
                resp = await asyncio.wait_for(replica.agenerate.remote(LLMRequest(list(self.prompt), sampling)), 300)
            except Exception as exc:  # noqa: BLE001 - reported in the JSON, the run goes on
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(0.5)
                continue
            self.records.append((t0, time.time(), len(resp.output_tokens)))

    async def start(self) -> bool:
        self.running, self.records, self.errors = True, [], []
        self.tasks = [asyncio.get_running_loop().create_task(self._loop(r))
                      for r in self.replicas for _ in range(self.concurrency)]
        return True

    async def stop(self, timeout_s: float = 300.0) -> dict:
        """Stop issuing; wait for the requests in flight; return (start, end, tokens) of each request."""
        self.running = False
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)
        return {"records": self.records, "errors": self.errors}


def build_model(hidden_size: int, layers: int) -> str:
    from rayllm_rl.models.tiny import TinyModelSpec, ensure_tiny_model

    heads = max(1, hidden_size // 64)
    return ensure_tiny_model(TinyModelSpec(hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                                           num_hidden_layers=layers, num_attention_heads=heads,
                                           num_key_value_heads=max(1, heads // 2)))


def bounded(fn, timeout_s: float, what: str):
    """`fn()` on a thread, waited for at most `timeout_s` (Ray's collective-group calls have no deadline)."""
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised below
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        raise TimeoutError(f"{what}: not done within {timeout_s:g}s")
    if "error" in box:
        raise RuntimeError(f"{what}: {box['error']}") from box["error"]
    return box.get("value")


class Bench:
    """The driver: forms groups, runs syncs, checks checksums, keeps every sample.

    Each group key has its own sender process, kept with its Ray collective group (rdt_*) until
    `close`: Ray's gloo collective initialises a process's torch.distributed once, so a process
    joins one such group in its life (a second one never meets its peers)."""

    def __init__(self, model_path: str, metas: tuple, bucket_bytes: int, timeout_s: float):
        self.model_path, self.metas = model_path, metas
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.version = 0
        self.samples: list[dict] = []
        self.memcpy_s: dict[str, list[float]] = {"idle": [], "generating": []}
        self.senders: dict[str, object] = {}
        self.collective: dict[str, object] = {}

    def get(self, refs, timeout_s: float | None = None):
        return ray.get(refs, timeout=timeout_s or self.timeout_s + 60)

    def sender(self, key: str):
        if key not in self.senders:
            sender = Sender.remote(self.model_path)
            self.get(sender.size.remote(), 300)  # loaded
            self.senders[key] = sender
        return self.senders[key]

    def close(self) -> None:
        """Destroy the collective groups and end the senders; best effort (the replicas may be gone)."""
        for key, group in list(self.collective.items()):
            try:
                bounded(lambda: destroy_collective_group(group), 30.0, f"{key}: destroying the collective group")
            except (RuntimeError, TimeoutError) as exc:
                print(f"{key}: {exc}", file=sys.stderr)
        self.collective.clear()
        for key, sender in self.senders.items():
            try:
                self.get(sender.close.remote(), 60)  # unlinks shm segments, closes groups
            except ray.exceptions.RayError as exc:
                print(f"{key}: closing the sender: {exc}", file=sys.stderr)
            ray.kill(sender, no_restart=True)
        self.senders.clear()

    def form(self, key: str, transport: str, replicas: list) -> float:
        """One group (as `cluster.form_sync_group` does), then an untimed, checked warm-up sync (first
        touch of fresh segments and store pages, first connections); returns the forming seconds."""
        sender = self.sender(key)
        t0 = time.perf_counter()
        host = self.get(sender.node_ip.remote())
        ranks = self.get([r.receiving_processes.remote(transport) for r in replicas])
        info = transport_info(transport)
        readers = list(zip(replicas, self.get([r.node_id.remote() for r in replicas]))) if info.needs_readers else ()
        spec = make_spec(transport, self.metas, receivers=sum(ranks), timeout_s=self.timeout_s,
                         bucket_bytes=self.bucket_bytes, host=host, readers=readers)
        first = [1 + sum(ranks[:i]) for i in range(len(replicas))]
        # as cluster.form_sync_group: the sender's end opened first (a group binds its store: the replicas get
        # the port it bound), then finished while the replicas join
        spec = spec.with_init(self.get(sender.open.remote(key, spec)))
        self.get([sender.finish.remote(key)] + [r.init_update_group.remote(spec.for_rank(k))
                                                for r, k in zip(replicas, first)])
        backend = getattr(spec.info, "tensor_transport", None)
        if backend and key not in self.collective:  # Ray Direct Transport: a Ray collective group of sender + replicas
            self.collective[key] = bounded(lambda: create_collective_group([sender, *replicas], backend=backend),
                                           self.timeout_s, f"{key}: Ray's {backend} collective group")
        form_s = time.perf_counter() - t0
        warm = self.sync(key, transport, replicas)
        if not (warm["checksums_equal"] and warm["versions_ok"]):
            raise RuntimeError(f"{key}: the warm-up sync delivered other weights than were sent: {warm}")
        return form_s

    def leave(self, key: str, replicas: list) -> None:
        """Close both ends of the group (a collective group stays, see the class docstring)."""
        self.get([self.sender(key).close.remote(key)] + [r.leave_update_group.remote() for r in replicas])

    def sync(self, key: str, transport: str, replicas: list) -> dict:
        """One version, end to end as the driver sees it, then every replica's checksum is checked."""
        self.version += 1
        v = self.version
        sender = self.sender(key)
        expected = self.get(sender.perturb.remote(v))
        info = transport_info(transport)
        rdt = getattr(info, "tensor_transport", None)
        head = sender.send.options(tensor_transport=rdt) if rdt else sender.send
        t0 = time.perf_counter()
        sent = head.remote(key, v)
        got = [r.receive_weights.remote(handoff_arg(info, sent)) for r in replicas]  # references only, never bytes
        # as Cluster.sync_weights: a replica's receive ends after the send; an RDT result is not fetchable here
        outs = self.get(got if rdt else got + [sent])[:len(got)]
        e2e = time.perf_counter() - t0
        del sent
        stats = self.get(sender.last_stats.remote(key))
        sums = self.get([r.checksum.remote() for r in replicas])
        rel = max(abs(s - expected) / max(abs(expected), 1e-30) for s in sums)
        return {"version": v, "e2e_s": e2e, "send_s": stats["send_s"], "bytes": stats["bytes"],
                "receive_s": max(o["receive_s"] for o in outs), "stall_s": max(o["stall_s"] for o in outs),
                # vLLM: the stall's parts (pause, load, finish = re-processing), of the slowest replica
                **{k: max(o[k] for o in outs) for k in outs[0] if k.startswith("stall_") and k != "stall_s"},
                "versions_ok": all(int(o["version"]) == v for o in outs),
                "checksum_rel_diff": rel, "checksums_equal": rel <= CHECKSUM_RTOL}

    def timed(self, key: str, transport: str, replicas: list, phase: str, syncs: int, pause_s: float,
              form_s: float) -> None:
        self.memcpy_s[phase].append(self.get(self.sender(key).memcpy.remote()))
        for _ in range(syncs):
            time.sleep(pause_s)  # let the replicas decode steadily between syncs
            s = self.sync(key, transport, replicas)
            self.samples.append({"transport": transport, "phase": phase, "form_s": form_s, **s})
            print(f"  {key:22s} {phase:10s} v{s['version']:<3d} e2e {1e3 * s['e2e_s']:7.1f} ms  send "
                  f"{1e3 * s['send_s']:7.1f}  receive {1e3 * s['receive_s']:7.1f}  stall {1e3 * s['stall_s']:6.2f} ms"
                  f"  checksums equal: {s['checksums_equal']}", file=sys.stderr)


def summarize(samples: list[dict], nbytes: int, memcpy_bps: float) -> dict:
    """Per phase and transport: medians of the timed syncs, bandwidths, the stall ratio."""
    out: dict = {}
    for s in samples:
        out.setdefault(s["phase"], {}).setdefault(s["transport"], []).append(s)
    for phase, by_t in out.items():
        for t, ss in by_t.items():
            e2e = statistics.median(x["e2e_s"] for x in ss)
            by_t[t] = {
                "syncs": len(ss),
                "e2e_s_median": e2e, "e2e_s_min": min(x["e2e_s"] for x in ss), "e2e_s_max": max(x["e2e_s"] for x in ss),
                "bytes_per_s": nbytes / e2e, "vs_memcpy": nbytes / e2e / memcpy_bps,
                "send_s_median": statistics.median(x["send_s"] for x in ss),
                "send_bytes_per_s": nbytes / statistics.median(x["send_s"] for x in ss),
                "receive_s_median": statistics.median(x["receive_s"] for x in ss),
                "stall_s_median": statistics.median(x["stall_s"] for x in ss),
                # a pull transport's phases run one after the other: what is left is Ray's task dispatch
                # and argument resolution, waiting for a decode step to end (the swap), and the replies
                **({"rest_s_median": statistics.median(x["e2e_s"] - x["send_s"] - x["receive_s"] - x["stall_s"]
                                                       for x in ss)} if TRANSPORTS[t].pulls else {}),
                **{f"{k}_median": statistics.median(x[k] for x in ss)
                   for k in ss[0] if k.startswith("stall_") and k.endswith("_s") and k != "stall_s"},
                "stall_s_max": max(x["stall_s"] for x in ss),
                "stall_fraction_of_sync_max": max(x["stall_s"] / x["e2e_s"] for x in ss),
                "form_s_median": statistics.median(x["form_s"] for x in ss),
                "checksums_equal": all(x["checksums_equal"] and x["versions_ok"] for x in ss),
                "checksum_rel_diff_max": max(x["checksum_rel_diff"] for x in ss),
                "samples_ms": [round(1e3 * x["e2e_s"], 2) for x in ss],
            }
    return out


def load_summary(result: dict, seconds: float) -> dict:
    recs = result["records"]
    tokens = sum(n for _, _, n in recs)
    return {"requests": len(recs), "generated_tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
            "errors": result["errors"][:5], "n_errors": len(result["errors"])}


def start_replicas(engine: str, n: int, model_path: str, args) -> list:
    from rayllm_rl.inference.registry import EngineSpec
    from rayllm_rl.orchestration.ray.actors import InferenceReplica

    vllm_options = {"kv_cache_mb": args.kv_cache_mb, "max_num_seqs": 64} if engine == "vllm" else None
    replicas = [InferenceReplica.remote(EngineSpec(engine, model_path, seed=i, options=vllm_options or {}))
                for i in range(n)]
    ray.get([r.ready.remote() for r in replicas], timeout=600)
    return replicas


def stop_replicas(replicas: list) -> None:
    ray.get([r.close.remote() for r in replicas], timeout=120)
    for r in replicas:
        ray.kill(r, no_restart=True)


def run_transformers(args, model_path: str, bench: Bench, transports: list[str], prompt_ids: list[int]) -> dict:
    """`--replicas` Transformers replicas per transport, each set in its own group for the whole run
    (a set of replicas never changes transport, as in a job); idle rounds, then generating rounds
    in which only the set being synced generates. Transports interleaved round by round."""
    t0 = time.perf_counter()
    sets = {t: start_replicas("transformers", args.replicas, model_path, args) for t in transports}
    start_s = time.perf_counter() - t0
    print(f"transformers: {len(transports)} x {args.replicas} replicas ready in {start_s:.1f} s", file=sys.stderr)
    loads = {t: Load.remote(rs, prompt_ids, args.max_new_tokens, args.concurrency) for t, rs in sets.items()}
    records, errors, gen_s = [], [], 0.0
    try:
        form_s = {t: bench.form(f"transformers-{t}", t, rs) for t, rs in sets.items()}
        for _ in range(args.repeats):
            for t, rs in sets.items():
                bench.timed(f"transformers-{t}", t, rs, "idle", args.syncs, 0.0, form_s[t])
        for _ in range(args.repeats):
            for t, rs in sets.items():
                g0 = time.perf_counter()
                ray.get(loads[t].start.remote(), timeout=60)
                try:
                    time.sleep(args.warmup_s)  # decoding steadily before the first timed sync
                    bench.timed(f"transformers-{t}", t, rs, "generating", args.syncs, args.pause_s, form_s[t])
                finally:
                    got = ray.get(loads[t].stop.remote(), timeout=600)
                    gen_s += time.perf_counter() - g0
                    records += got["records"]
                    errors += got["errors"]
        for t, rs in sets.items():
            bench.leave(f"transformers-{t}", rs)
    finally:
        for rs in sets.values():
            stop_replicas(rs)
    return {"engine": "transformers", "replicas": args.replicas, "start_s": start_s,
            "generation_load": load_summary({"records": records, "errors": errors}, gen_s)}


def run_vllm(args, model_path: str, bench: Bench, transports: list[str], prompt_ids: list[int]) -> dict:
    """One vLLM replica; each block forms that transport's group (+ a warm-up sync), times its syncs
    and leaves it; generating rounds keep requests in flight on the replica the whole time."""
    t0 = time.perf_counter()
    rs = start_replicas("vllm", 1, model_path, args)
    start_s = time.perf_counter() - t0
    print(f"vllm: 1 replica ready in {start_s:.1f} s", file=sys.stderr)

    def block(t: str, phase: str, pause_s: float) -> None:
        form_s = bench.form(f"vllm-{t}", t, rs)
        try:
            bench.timed(f"vllm-{t}", t, rs, phase, args.syncs, pause_s, form_s)
        finally:
            bench.leave(f"vllm-{t}", rs)

    try:
        for _ in range(args.repeats):
            for t in transports:
                block(t, "idle", 0.0)
        load = Load.remote(rs, prompt_ids, args.max_new_tokens, args.concurrency)
        ray.get(load.start.remote(), timeout=60)
        g0 = time.perf_counter()
        try:
            time.sleep(args.warmup_s)
            for _ in range(args.repeats):
                for t in transports:
                    block(t, "generating", args.pause_s)
        finally:
            loaded = ray.get(load.stop.remote(), timeout=600)
            gen_s = time.perf_counter() - g0
    finally:
        stop_replicas(rs)
    return {"engine": "vllm", "replicas": 1, "start_s": start_s, "generation_load": load_summary(loaded, gen_s)}


def run_setup(runner, args, model_path, metas, transports, prompt_ids) -> tuple[dict, Bench]:
    bench = Bench(model_path, metas, int(args.bucket_mb * (1 << 20)), args.timeout_s)
    try:
        out = runner(args, model_path, bench, transports, prompt_ids)
    finally:
        bench.close()
    out["checksums_equal"] = all(s["checksums_equal"] and s["versions_ok"] for s in bench.samples)
    return out, bench


RAY_PATHS = ("object_store", "ray_channel", "rdt_gloo")
"""The Ray transports the issue's targets are checked for (the object store is the one it names)."""


def targets(setup: dict, memcpy_bps: float) -> dict:
    """The issue's three targets for each Ray path present, from one setup's figures."""
    gen, idle = setup.get("generating", {}), setup.get("idle", {})
    out: dict = {}
    for t in (t for t in RAY_PATHS if t in gen or t in idle):
        if t in gen and "shm" in gen:
            v = gen[t]["bytes_per_s"] / gen["shm"]["bytes_per_s"]
            out[f"{t}_vs_shm_generating"] = {"value": v, "target": TARGETS["object_store_vs_shm_generating"],
                                             "met": v >= TARGETS["object_store_vs_shm_generating"]}
        if t in idle and "shm" in idle:  # no target: how far the idle transports are apart
            out[f"{t}_vs_shm_idle"] = {"value": idle[t]["bytes_per_s"] / idle["shm"]["bytes_per_s"]}
        if t in idle:
            v = idle[t]["bytes_per_s"] / memcpy_bps
            out[f"{t}_idle_vs_memcpy"] = {"value": v, "target": TARGETS["object_store_idle_vs_memcpy"],
                                          "met": v >= TARGETS["object_store_idle_vs_memcpy"]}
        if t in gen:
            v = gen[t]["stall_fraction_of_sync_max"]
            out[f"{t}_stall_fraction_of_sync_max"] = {"value": v, "target": TARGETS["stall_fraction_of_sync"],
                                                      "met": v <= TARGETS["stall_fraction_of_sync"]}
    return out


def code_version() -> str:
    """The checkout's commit, '+dirty' if rayllm_rl/ or this script differ from it."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "rayllm_rl",
                                "benchmarks/weight_sync.py"], capture_output=True, text=True, timeout=10).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="Transformers replicas")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=0.0,
                   help="bucket size (the job's ray.sync_bucket_mb; 0 = each transport's default)")
    p.add_argument("--repeats", type=int, default=4, help="rounds per phase; each round visits every transport")
    p.add_argument("--syncs", type=int, default=2, help="timed syncs per transport per round (after a warm-up)")
    p.add_argument("--transports", default=",".join(t for t, i in TRANSPORTS.items() if not i.gpu_only),
                   help="comma-separated; default: every CPU transport of the registry")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM replica")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per replica while generating")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--kv-cache-mb", type=int, default=128)
    p.add_argument("--pause-s", type=float, default=0.3, help="generating: pause before each timed sync")
    p.add_argument("--warmup-s", type=float, default=2.0, help="generating: load runs this long before the first group")
    p.add_argument("--timeout-s", type=float, default=120.0, help="weight-sync timeout of every phase")
    p.add_argument("--object-store-mb", type=int, default=0,
                   help="Ray's object store size; 0: Ray's default (30%% of RAM), what a job gets")
    p.add_argument("--out", default="benchmarks/results/weight_sync.json")
    p.add_argument("--code-version", default="", help="recorded in the JSON (default: the checkout's git commit)")
    args = p.parse_args()
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS or TRANSPORTS[t].gpu_only]
    if bad or not transports:
        raise SystemExit(f"--transports: {bad or 'none given'}; CPU transports: "
                         f"{[t for t, i in TRANSPORTS.items() if not i.gpu_only]}")
    if args.repeats < 1 or args.syncs < 1:
        raise SystemExit("--repeats and --syncs must be >= 1")
    torch.set_num_threads(1)
    wall0 = time.perf_counter()
    model_path = build_model(args.hidden_size, args.layers)
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_path).encode("count the numbers one two three")

    temp_dir = f"/tmp/rayllm-wsbench-{os.getpid()}"
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=True,
             object_store_memory=(args.object_store_mb << 20) or None, _system_config=LOCAL_SYSTEM_CONFIG,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                                       "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                                       # actors import rayllm_rl from this checkout, as the driver does
                                       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                   os.environ.get("PYTHONPATH")]))}})
    try:
        probe = Sender.remote(model_path)
        metas = ray.get(probe.metas.remote(), timeout=300)
        params, nbytes = ray.get(probe.size.remote(), timeout=60)
        ray.kill(probe, no_restart=True)
        print(f"model {model_path}: {params} params, {nbytes} bytes ({nbytes / 1e6:.1f} MB) float32",
              file=sys.stderr)
        common = (args, model_path, metas, transports, prompt_ids)
        runs = {"transformers": run_setup(run_transformers, *common)}
        if not args.no_vllm:
            runs["vllm"] = run_setup(run_vllm, *common)
    finally:
        ray.shutdown()
    # the yardstick: memcpy in the sender's process, sampled before every block of syncs
    memcpy_s = {ph: [x for _, b in runs.values() for x in b.memcpy_s[ph]] for ph in ("idle", "generating")}
    memcpy_bps = nbytes / statistics.median(memcpy_s["idle"])
    setups = {}
    for name, (info, bench) in runs.items():
        setups[name] = {**info, **summarize(bench.samples, nbytes, memcpy_bps)}
    out = {
        "code_version": args.code_version or code_version(),
        "object_store_mb": args.object_store_mb or "ray default",
        "model": {"params": params, "bytes": nbytes, "hidden_size": args.hidden_size, "layers": args.layers,
                  "dtype": "float32"},
        "memcpy_bytes_per_s": memcpy_bps,
        "memcpy": {ph: {"samples": len(v), "bytes_per_s_median": nbytes / statistics.median(v),
                        "bytes_per_s_max": nbytes / min(v), "bytes_per_s_min": nbytes / max(v)}
                   for ph, v in memcpy_s.items() if v},
        "config": {k: getattr(args, k) for k in ("replicas", "bucket_mb", "repeats", "syncs", "concurrency",
                                                 "max_new_tokens", "pause_s", "kv_cache_mb")},
        "transports": transports, "cpu_count": os.cpu_count(),
        "targets_transformers_x2": targets(setups["transformers"], memcpy_bps),
        "targets_vllm": targets(setups["vllm"], memcpy_bps) if "vllm" in setups else None,
        "checksums_equal": all(s["checksums_equal"] for s in setups.values()),
        **setups,
        "wall_s": time.perf_counter() - wall0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
