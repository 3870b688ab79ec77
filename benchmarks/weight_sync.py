"""Weight sync learner -> K replicas: bytes/s against memcpy, and generation stall against sync time.

The sender (this process) streams a model's full weights in buckets over the stateless gloo
group to K replica processes. Each replica keeps generating in a thread while it receives
into its back buffer, then swaps between two decode steps. Memcpy bandwidth is measured in
the same run on the same tensors. Goals: sync >= 50% of memcpy bandwidth; stall <= 5% of
the sync time.

    .venv/bin/python benchmarks/weight_sync.py [--replicas 2] [--hidden-size 512 --layers 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replica_main(model_path, port, rank, world, bucket_bytes, repeats, queue):
    import torch

    torch.set_num_threads(1)
    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
    from rayllm_rl.inference.transformers_engine import TransformersEngine
    from rayllm_rl.weight_sync import DoubleBufferReceiver, StatelessGlooGroup, WeightReceiver, metadata_of

    engine = TransformersEngine(model_path)
    group = StatelessGlooGroup("127.0.0.1", port, rank, world, 120.0)
    receiver = DoubleBufferReceiver(engine, WeightReceiver(group, metadata_of(engine.named_parameters()), bucket_bytes))
    stop = threading.Event()

    def generate_forever():
        prompt = engine.tokenizer.encode("count the numbers one two three")
        while not stop.is_set():
            engine.generate([LLMRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=64, ignore_eos=True))] * 4)

    gen = threading.Thread(target=generate_forever, daemon=True)
    gen.start()
    results = []
    for _ in range(repeats):
        steps_before = engine.stats.decode_steps
        out = receiver.receive_and_swap()
        out["decode_steps_during_sync"] = engine.stats.decode_steps - steps_before
        results.append(out)
    stop.set()
    gen.join(timeout=60)
    group.close()
    queue.put(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from rayllm_rl.models.tiny import TinyModelSpec, ensure_tiny_model
    from rayllm_rl.weight_sync import StatelessGlooGroup, WeightSender, find_free_port, metadata_of
    from transformers import AutoModelForCausalLM

    path = ensure_tiny_model(TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                                           num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4))
    model = AutoModelForCausalLM.from_pretrained(path)
    named = {k: v.detach() for k, v in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    bucket = int(args.bucket_mb * (1 << 20))

    # memcpy of the same tensors into preallocated destinations, same process, same run
    dst = {k: torch.empty_like(v) for k, v in named.items()}
    memcpy_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        for k, v in named.items():
            dst[k].copy_(v)
        memcpy_s.append(time.perf_counter() - t0)
    memcpy_bps = nbytes / statistics.median(memcpy_s)

    port, world = find_free_port(), 1 + args.replicas
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=replica_main, args=(path, port, r + 1, world, bucket, args.repeats, queue))
             for r in range(args.replicas)]
    for proc in procs:
        proc.start()
    group = StatelessGlooGroup("127.0.0.1", port, 0, world, 120.0)
    sender = WeightSender(group, metadata_of(named), bucket)
    sends = []
    for v in range(1, args.repeats + 1):
        time.sleep(1.0)  # let the replicas generate between syncs
        sends.append(sender.send(named, v))
    replica_results = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    group.close()

    sync_s = statistics.median(s.seconds for s in sends)
    stalls = [r["stall_s"] for rs in replica_results for r in rs]
    receives = [r["receive_s"] for rs in replica_results for r in rs]
    out = {
        "model_params": sum(t.numel() for t in named.values()), "bytes": nbytes, "replicas": args.replicas,
        "bucket_mb": args.bucket_mb, "repeats": args.repeats,
        "sync_seconds_median": sync_s, "sync_bytes_per_s": nbytes / sync_s,
        "sync_bytes_per_s_all_replicas": nbytes * args.replicas / sync_s,
        "memcpy_bytes_per_s": memcpy_bps,
        "sync_vs_memcpy": nbytes / sync_s / memcpy_bps,
        "stall_seconds_max": max(stalls), "receive_seconds_median": statistics.median(receives),
        "stall_fraction_of_sync": max(stalls) / sync_s,
        "decode_steps_during_sync": [r["decode_steps_during_sync"] for rs in replica_results for r in rs],
        "goals": {"sync_vs_memcpy": 0.5, "stall_fraction_of_sync": 0.05},
        "transport": "stateless gloo (TCP loopback)", "cpu_count": os.cpu_count(),
    }
    out["meets_goals"] = out["sync_vs_memcpy"] >= 0.5 and out["stall_fraction_of_sync"] <= 0.05
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
