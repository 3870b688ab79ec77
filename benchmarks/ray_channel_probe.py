"""Is Ray's mutable-object channel a faster carrier than put/get? One writer actor, one reader actor, one node.

The object-store transport (weight_sync/object_store.py) puts each version as a new object; Compiled
Graphs' `shared_memory_channel.Channel` writes into one mutable object the readers keep mapped. This
times both with the payload of `benchmarks/weight_sync.py` (101.5 MB as 130 uint8 buffers, cut into
pieces of at most 1 MiB as the object store cuts them), against a plain memcpy of the same bytes:

- `put` / `write`: inside the writer actor; `get` / `read`: inside the reader actor (a read waits for
  the write, so it includes it);
- `end_to_end`: the driver's view of one version, from the writer's call to the reader's answer.

Medians of `--repeats` versions per path, the paths one after the other in one Ray session.

    .venv/bin/python benchmarks/ray_channel_probe.py   # -> benchmarks/results/ray_channel_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rayllm_rl.weight_sync.object_store import _pieces  # noqa: E402  (the object store's own cut)

TENSORS = 130
NBYTES = 101_500_000


@ray.remote
class Writer:
    def __init__(self, nbytes: int, tensors: int):
        rng = np.random.default_rng(0)
        self.buffers = [rng.integers(0, 255, nbytes // tensors, dtype=np.uint8) for _ in range(tensors)]
        self.channel = None

    def pieces(self) -> list:
        return [p for b in self.buffers for p in _pieces(b)]

    def put(self) -> tuple[list, float]:
        t0 = time.perf_counter()
        ref = ray.put(self.pieces())
        return [ref], time.perf_counter() - t0  # the reference inside a list: the reader fetches it itself

    def open_channel(self, reader, node_id: str, capacity: int):
        from ray.experimental.channel.shared_memory_channel import Channel

        self.channel = Channel(ray.get_runtime_context().current_actor, [(reader, node_id)], capacity)
        return self.channel

    def write(self, timeout_s: float) -> float:
        t0 = time.perf_counter()
        self.channel.write(self.pieces(), timeout=timeout_s)
        return time.perf_counter() - t0


@ray.remote
class Reader:
    def get(self, refs: list, timeout_s: float) -> tuple[float, int, bool]:
        t0 = time.perf_counter()
        got = ray.get(refs[0], timeout=timeout_s)
        return time.perf_counter() - t0, sum(b.nbytes for b in got), not got[0].flags.writeable

    def read(self, channel, timeout_s: float) -> tuple[float, int, bool]:
        t0 = time.perf_counter()
        got = channel.read(timeout=timeout_s)  # also releases the previous version of this channel
        return time.perf_counter() - t0, sum(b.nbytes for b in got), not got[0].flags.writeable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ray_channel_probe.json"))
    a = p.parse_args(argv)
    temp = tempfile.mkdtemp(prefix="rayllm-chprobe-")
    from rayllm_rl.orchestration.ray.session import LOCAL_SYSTEM_CONFIG

    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             _system_config=dict(LOCAL_SYSTEM_CONFIG))
    try:
        writer, reader = Writer.remote(NBYTES, TENSORS), Reader.remote()
        node = ray.get_runtime_context().get_node_id()
        times: dict[str, list[float]] = {k: [] for k in ("put", "get", "store_end_to_end", "write", "read",
                                                         "channel_end_to_end")}
        checks = []
        for _ in range(a.repeats + 1):  # the first of each path warms up
            t0 = time.perf_counter()
            refs, put_s = ray.get(writer.put.remote(), timeout=a.timeout_s)
            get_s, nbytes, view = ray.get(reader.get.remote(refs, a.timeout_s), timeout=a.timeout_s)
            times["store_end_to_end"].append(time.perf_counter() - t0)
            times["put"].append(put_s), times["get"].append(get_s), checks.append(("store", nbytes, view))
            del refs
        channel = ray.get(writer.open_channel.remote(reader, node, NBYTES + (8 << 20)), timeout=a.timeout_s)
        for _ in range(a.repeats + 1):
            t0 = time.perf_counter()
            wrote = writer.write.remote(a.timeout_s)
            read_s, nbytes, view = ray.get(reader.read.remote(channel, a.timeout_s), timeout=a.timeout_s)
            write_s = ray.get(wrote, timeout=a.timeout_s)
            times["channel_end_to_end"].append(time.perf_counter() - t0)
            times["write"].append(write_s), times["read"].append(read_s), checks.append(("channel", nbytes, view))
    finally:
        ray.shutdown()
    src = np.random.default_rng(1).integers(0, 255, NBYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    memcpy = []
    for _ in range(a.repeats + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    med["memcpy"] = statistics.median(memcpy[1:])
    payload = NBYTES // TENSORS * TENSORS
    result = {"bytes": payload, "buffers": TENSORS, "repeats": a.repeats, "cpus": os.cpu_count(),
              "median_s": med, "memcpy_fraction": {"store": med["memcpy"] / med["store_end_to_end"],
                                                   "channel": med["memcpy"] / med["channel_end_to_end"]},
              "every_read_zero_copy": all(view for _, _, view in checks),
              "every_read_complete": all(n == payload for _, n, _ in checks)}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result["every_read_complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
