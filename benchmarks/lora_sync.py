"""Weight sync of a LoRA policy against full weights, side by side in one Ray run, on the h256x6 Qwen2.

The model is the Qwen2 of `benchmarks/rehearsal.py` (hidden 256, 6 layers, MLP 768, 8 heads, 4 KV
heads, built offline). For each engine (`--engines`, default Transformers and vLLM's CPU build) and
each policy kind (full weights; LoRA rank `--rank` on the attention and MLP projections, the default
targets) the job's own actors are used: a `LearnerWorker` (a real `Learner`, with `lora=` for LoRA)
as learner rank 0 and an `InferenceReplica`, joined over `--transport` (default `object_store`, the
job's default on CPU) with the registry's `make_spec`, as `cluster.form_sync_group` does. A sync is
what `Cluster.sync_weights` does: learner rank 0's `send_weights(v)` and the replica's
`receive_weights` of its result reference; after each one the replica's checksum must equal the
learner's. One untimed warm-up sync, then `--syncs` timed ones, the kinds interleaved round by round.

Per sync (medians): bytes sent (learner rank 0's `sync_bytes`), end to end as the driver sees it,
the sender's time, the replica's receive and its stall (generation held: Transformers' swap; vLLM's
pause + load + resume, which for LoRA is writing nothing, `add_lora` in place of the layerwise reload).

    .venv/bin/python benchmarks/lora_sync.py [--rank 8] [--syncs 5] [--engines transformers,vllm]

Prints one JSON object and writes it to benchmarks/results/lora_sync.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model() -> tuple[str, dict]:
    """The h256x6 Qwen2 of benchmarks/rehearsal.py (same spec), built once and cached."""
    from rayllm_rl.models.tiny import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4)
    return ensure_tiny_model(spec), {"hidden_size": 256, "layers": 6, "intermediate_size": 768}


def start_pair(kind: str, engine: str, model_path: str, rank: int, transport: str, timeout_s: float):
    """(learner rank 0, replica) of one policy kind, their sync group formed."""
    import ray

    from rayllm_rl.inference.registry import EngineSpec
    from rayllm_rl.lora import LoraOptions
    from rayllm_rl.learner.learner import LearnerSpec, OptimConfig
    from rayllm_rl.objectives import GRPOLoss
    from rayllm_rl.orchestration.ray.actors import InferenceReplica, LearnerWorker
    from rayllm_rl.weight_sync.registry import make_spec

    lora = LoraOptions(rank=rank) if kind == "lora" else None
    learner = LearnerWorker.remote(0, 1, 1)
    host, port = ray.get(learner.rendezvous.remote(timeout_s), timeout=timeout_s)  # one rank: port 0, no group
    ray.get(learner.setup.remote(LearnerSpec(model_path, OptimConfig(), lora=lora), GRPOLoss(), host, port),
            timeout=timeout_s)
    options = {"kv_cache_mb": 64} if engine == "vllm" else {}
    replica = InferenceReplica.remote(EngineSpec(engine, model_path, options=options, lora=lora))
    ray.get(replica.ready.remote(), timeout=timeout_s)
    receivers = ray.get(replica.receiving_processes.remote(transport), timeout=timeout_s)
    spec = make_spec(transport, ray.get(learner.weight_metadata.remote(), timeout=timeout_s), receivers=receivers,
                     timeout_s=timeout_s, bucket_bytes=16 << 20, host=host)
    # as cluster.form_sync_group: learner rank 0 opens its end first (a group binds its store: the replica
    # gets the port it bound), then finishes it while the replica joins
    spec = spec.with_init(ray.get(learner.open_weight_sender.remote(spec), timeout=timeout_s + 30))
    ray.get([learner.finish_weight_sender.remote(), replica.init_update_group.remote(spec.for_rank(1))],
            timeout=timeout_s + 30)
    return learner, replica


def one_sync(learner, replica, version: int, pulls: bool, timeout_s: float) -> dict:
    """`Cluster.sync_weights` for one learner rank and one replica; checks the checksums after."""
    import ray

    t0 = time.perf_counter()
    sent = learner.send_weights.remote(version)
    got = replica.receive_weights.remote(sent if pulls else None)
    rec, _ = ray.get([got, sent], timeout=timeout_s)
    end_to_end = time.perf_counter() - t0
    stats = ray.get(learner.last_send_stats.remote(), timeout=timeout_s)
    mine, theirs = ray.get([learner.checksum.remote(), replica.checksum.remote()], timeout=timeout_s)
    if abs(mine - theirs) > 1e-6 * max(1.0, abs(mine)):
        raise AssertionError(f"after sync {version} the replica's checksum {theirs} != the learner's {mine}")
    return {"bytes": int(stats["sync_bytes"]), "end_to_end_s": end_to_end, "send_s": stats["sync_s"],
            "receive_s": float(rec["receive_s"]), "stall_s": float(rec["stall_s"])}


def median_of(rows: list[dict]) -> dict:
    return {k: (rows[0][k] if k == "bytes" else statistics.median(r[k] for r in rows)) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (model.lora.rank)")
    p.add_argument("--syncs", type=int, default=5, help="timed syncs per kind (after one warm-up)")
    p.add_argument("--engines", default="transformers,vllm")
    p.add_argument("--transport", default="object_store")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora_sync.json"))
    args = p.parse_args()

    import ray

    from rayllm_rl.weight_sync.registry import transport_info

    model_path, model = build_model()
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=f"/tmp/rl_lorasync_{os.getpid()}",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    pulls = transport_info(args.transport).pulls
    result: dict = {"benchmark": "lora_sync", "model": model, "lora_rank": args.rank,
                    "lora_targets": "q,k,v,o,gate,up,down projections", "transport": args.transport,
                    "syncs": args.syncs, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "engines": {}}
    try:
        for engine in [e for e in args.engines.split(",") if e]:
            pairs = {kind: start_pair(kind, engine, model_path, args.rank, args.transport, args.timeout_s)
                     for kind in ("full", "lora")}
            rows: dict[str, list] = {kind: [] for kind in pairs}
            for version in range(args.syncs + 1):  # version 0: the warm-up, not timed
                for kind, (learner, replica) in pairs.items():
                    row = one_sync(learner, replica, version, pulls, args.timeout_s)
                    if version:
                        rows[kind].append(row)
            med = {kind: median_of(r) for kind, r in rows.items()}
            med["lora_over_full"] = {k: med["lora"][k] / med["full"][k] for k in ("bytes", "end_to_end_s", "stall_s")
                                     if med["full"][k] > 0}
            result["engines"][engine] = med
            print(json.dumps({engine: med}), file=sys.stderr)
            for learner, replica in pairs.values():
                ray.get([learner.close.remote(), replica.close.remote()], timeout=args.timeout_s)
                ray.kill(learner)
                ray.kill(replica)
    finally:
        ray.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
