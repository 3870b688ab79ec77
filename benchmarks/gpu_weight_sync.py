"""Learner → replica weight sync between two processes on one device, against a device copy of the same bytes.

The learner (`rayllm_rl.learner.Learner`) runs in this process and trains one step per version; the
replica (the Transformers engine) runs in a spawned process on the same device, as a colocated replica
actor does. Both ends come from the transport registry (`open_sender`, `engine.weights.init_update_group`):

- `--device cuda`: the colocated plan, `cuda_ipc` (the replica opens the learner's own GPU memory and
  copies device to device). NCCL cannot join two ranks on one GPU, so it is not measured here.
- `--device cpu`: a CPU transport that needs no Ray (`shm` or `gloo`): the smoke run of `make test`.

Per version: a GRPO step on the learner, then the sync, timed end to end (send start → the replica's
reply after its swap), `--syncs` times idle and `--syncs` times while the replica decodes. After the
last sync of each mode the replica's weights checksum must equal the learner's, and after all syncs the
replica generates again: every token must carry the last version, and the learner's logprobs of those
tokens are compared with the replica's. The baseline is a plain copy of the same bytes on the device,
one flat buffer and tensor by tensor.

    python benchmarks/gpu_weight_sync.py --device cuda          # Qwen2.5-0.5B shape, random init, bf16
    python benchmarks/gpu_weight_sync.py --device cpu --model tiny --transport shm --syncs 2

stdout gets the JSON (also written to `--out`); exit code 1 if any check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from gpu_check import (  # noqa: E402
    _positive, build_model_dir, describe_model, device_copy_seconds, logprob_abs_diff, sync, trajectory_batch,
)

# ---------------------------------------------------------------------------- the replica process
def _requests(n: int, prompt_len: int, new_tokens: int, vocab: tuple[int, int], seed: int):
    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(vocab[0], vocab[1], (n, prompt_len), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    return [LLMRequest(input_ids=p, sampling=sampling) for p in prompts]


def replica_main(conn, model_path: str, dtype: str, device: str, timeout_s: float) -> None:
    """The replica: a Transformers engine on `device`, driven by (command, args) messages over `conn`."""
    from rayllm_rl.inference.registry import build_engine, placed_options

    loop = asyncio.new_event_loop()

    def run(coro):
        return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    engine = background = None

    async def generate(reqs):
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    try:
        engine = build_engine("transformers", model_path, dtype=dtype,
                              options={**placed_options("transformers", {}, colocated=True), "device": device})
        run(engine.start())
        conn.send(("ready", str(engine.device)))
        while True:
            if not conn.poll(timeout_s):
                raise TimeoutError(f"replica: no command from the learner within {timeout_s:g}s")
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "init":
                run(engine.weights.init_update_group(args))
                conn.send(("ok", None))
            elif cmd == "generate":
                reqs = _requests(**args)
                conn.send(("ok", run(generate(reqs))))
            elif cmd == "receive":
                handoff, busy = args
                if busy is not None and background is None:  # decode without pause while the bytes arrive
                    async def keep_decoding(reqs):
                        while True:
                            await generate(reqs)

                    background = loop.create_task(keep_decoding(_requests(**busy)))
                    run(asyncio.sleep(0.05))  # the first decode step is under way
                if busy is None and background is not None:
                    background.cancel()
                    loop.run_until_complete(asyncio.gather(background, return_exceptions=True))
                    background = None
                conn.send(("ok", run(engine.weights.receive_weights(handoff))))
            elif cmd == "checksum":
                conn.send(("ok", run(engine.weights.weights_checksum())))
            else:
                raise ValueError(f"replica: unknown command {cmd!r}")
    except BaseException as exc:  # noqa: BLE001 - reported to the learner, which fails the run
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if background is not None:
            background.cancel()
            loop.run_until_complete(asyncio.gather(background, return_exceptions=True))
        if engine is not None:
            loop.run_until_complete(asyncio.wait_for(engine.weights.close_update_group(), timeout_s))
            loop.run_until_complete(asyncio.wait_for(engine.aclose(), timeout_s))
        loop.close()


class Replica:
    """The learner's handle on the replica process: each call waits at most `timeout_s` for its reply."""

    def __init__(self, model_path: str, dtype: str, device: str, timeout_s: float):
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.proc = ctx.Process(target=replica_main, args=(child, model_path, dtype, device, timeout_s), daemon=True)
        self.proc.start()
        self.device = self.reply("starting the engine")

    def reply(self, what: str):
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"replica: {what} did not answer within {self.timeout_s:g}s "
                               f"(alive: {self.proc.is_alive()})")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"replica failed during {what}: {value}")
        return value

    def ask(self, cmd: str, args=None, what: str | None = None):
        self.conn.send((cmd, args))
        return self.reply(what or cmd)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(self.timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


# ---------------------------------------------------------------------------- the learner side
def to_batch(responses, seed: int):
    """The replica's responses as a trajectory batch `[N, T]` (seeded rewards, GRPO advantages)."""
    return trajectory_batch(responses, torch.Generator().manual_seed(seed))


def logprob_diff(learner, responses) -> float:
    """max |learner − replica| logprob over the sampled tokens of `responses`."""
    return float(logprob_abs_diff(learner, to_batch(responses, 0)).max())


def per_tensor_copy_seconds(tensors: list[torch.Tensor], device: str, repeats: int = 5) -> float:
    """Median time to copy each tensor into a buffer of its own on the device (what a receiver does)."""
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    from rayllm_rl.inference.protocol import weights_checksum
    from rayllm_rl.learner.distributed import DistConfig
    from rayllm_rl.learner.learner import Learner, OptimConfig
    from rayllm_rl.objectives import GRPOLoss
    from rayllm_rl.weight_sync import metas_to_spec
    from rayllm_rl.weight_sync.registry import make_spec, open_sender, plan_transport

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    dname = str(dtype).removeprefix("torch.")
    transport = args.transport or plan_transport("auto", learner_gpus=cuda, replica_gpus=cuda, learner_node="n",
                                                 replica_nodes=["n"], colocated=True)
    out: dict = {"device": args.device, "device_name": torch.cuda.get_device_name() if cuda else "cpu",
                 "torch": torch.__version__, "transport": transport, "errors": []}
    workdir = Path(tempfile.mkdtemp(prefix="rayllm-gpusync-"))
    model_path = build_model_dir(args.model, workdir, args.seed, dtype)
    out["model"] = describe_model(args.model, model_path, dtype)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    vocab = (max(tok.all_special_ids) + 1, len(tok))
    gen = dict(n=args.requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens, vocab=vocab)

    replica = Replica(model_path, dname, args.device, args.timeout_s)
    sender = None
    try:
        learner = Learner(model_path, OptimConfig(lr=1e-5), seed=args.seed, dtype=dtype,
                          dist=DistConfig(backend="nccl") if cuda else None)
        metas = learner.weight_metas()
        spec = make_spec(transport, metas_to_spec(metas), receivers=1, timeout_s=args.timeout_s, host="127.0.0.1")
        opened = open_sender(spec, metas)  # learner rank 0's end first: a group binds its store here
        spec = spec.with_init(opened.init)
        replica.conn.send(("init", spec.for_rank(1)))  # the replica joins the port rank 0 bound
        sender = opened.finish()  # a group transport's ends meet here (<= timeout_s)
        replica.reply("init_update_group")
        nbytes = sum(m.nbytes for m in metas)
        out.update(bytes=int(nbytes), tensors=len(metas), replica_device=replica.device)

        responses = replica.ask("generate", {**gen, "seed": args.seed}, "generating the training batch")
        out["logprob_max_abs_diff_v0"] = logprob_diff(learner, responses)
        batch = to_batch(responses, args.seed)
        loss = GRPOLoss()

        version, syncs = 0, []
        for mode in ("idle", "generating"):
            busy = {**gen, "seed": args.seed + 1} if mode == "generating" else None
            for i in range(args.syncs + 1):  # the first of each mode warms up (allocator, handles, threads)
                learner.train_step(batch, loss)
                version += 1
                sync(args.device)
                t0 = time.perf_counter()
                if spec.info.pulls:
                    stats, handoff = sender.send(learner.iter_named_tensors(), version)
                    got = replica.ask("receive", (handoff, busy), f"receiving version {version}")
                else:
                    replica.conn.send(("receive", (None, busy)))
                    stats, _ = sender.send(learner.iter_named_tensors(), version)
                    got = replica.reply(f"receiving version {version}")
                total = time.perf_counter() - t0
                if int(got["version"]) != version:
                    out["errors"].append(f"{mode}: the replica swapped in version {got['version']}, sent {version}")
                if i:
                    syncs.append({"mode": mode, "version": version, "end_to_end_s": total, "send_s": stats.seconds,
                                  "receive_s": float(got["receive_s"]), "stall_s": float(got["stall_s"])})
            want = weights_checksum(learner.named_tensors())
            have = replica.ask("checksum", None, "weights_checksum")
            equal = abs(want - have) <= 1e-6 * max(1.0, abs(want))
            out[f"weights_equal_{mode}"] = equal
            if not equal:
                out["errors"].append(f"{mode}: after version {version} the replica's checksum {have!r} differs from "
                                     f"the learner's {want!r}")
        out["syncs"] = syncs

        after = replica.ask("generate", {**gen, "n": min(args.requests, 8), "seed": args.seed + 2}, "generating after")
        versions = sorted({v for r in after for v in r.output_versions})
        out["versions_after"] = versions
        if versions != [version]:
            out["errors"].append(f"tokens after the last sync carry versions {versions}, expected [{version}]")
        out["logprob_max_abs_diff_after"] = logprob_diff(learner, after)

        tensors = [t.detach() for _, t in learner.iter_named_tensors()]
        flat_s = device_copy_seconds(nbytes, args.device)
        each_s = per_tensor_copy_seconds(tensors, args.device)
        del tensors
        summary = {}
        for mode in ("idle", "generating"):
            rows = [s for s in syncs if s["mode"] == mode]
            e2e = statistics.median(s["end_to_end_s"] for s in rows)
            summary[mode] = {"end_to_end_s": e2e, "bytes_per_s": nbytes / e2e,
                             "receive_s": statistics.median(s["receive_s"] for s in rows),
                             "stall_s_max": max(s["stall_s"] for s in rows),
                             "stall_fraction_max": max(s["stall_s"] / s["end_to_end_s"] for s in rows),
                             "vs_flat_copy": flat_s / e2e, "vs_per_tensor_copy": each_s / e2e}
        out["summary"] = summary
        out["device_copy"] = {"flat_s": flat_s, "flat_bytes_per_s": nbytes / flat_s,
                              "per_tensor_s": each_s, "per_tensor_bytes_per_s": nbytes / each_s}
    finally:
        if sender is not None:
            sender.close()
        replica.close()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    from rayllm_rl.weight_sync.registry import TRANSPORTS

    cpu_transports = tuple(n for n, t in TRANSPORTS.items() if not t.gpu_only and not t.receiver_needs_ray)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=("qwen2-0.5b", "tiny"), default=None,
                   help="default: qwen2-0.5b on cuda, tiny on cpu")
    p.add_argument("--transport", choices=("cuda_ipc", *cpu_transports), default=None,
                   help="default: the colocated plan on cuda (cuda_ipc), shm on cpu")
    p.add_argument("--syncs", type=_positive(int), default=5, help="timed syncs per mode (after one warm-up)")
    p.add_argument("--requests", type=_positive(int), default=None, help="rows decoded together (32 cuda, 8 cpu)")
    p.add_argument("--prompt-len", type=_positive(int), default=None)
    p.add_argument("--new-tokens", type=_positive(int), default=None)
    p.add_argument("--timeout-s", type=_positive(float), default=300.0, help="bound of every wait on the other process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_weight_sync.json"))
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device here; pass --device cpu")
    if (a.transport == "cuda_ipc") != cuda and a.transport is not None:
        p.error(f"--transport {a.transport} needs --device {'cuda' if a.transport == 'cuda_ipc' else 'cpu'} "
                "(the two processes share one device: CUDA IPC on a GPU, a CPU transport without Ray on the CPU)")
    a.model = a.model or ("qwen2-0.5b" if cuda else "tiny")
    a.transport = a.transport or (None if cuda else "shm")
    a.requests = a.requests or (32 if cuda else 8)
    a.prompt_len = a.prompt_len or (128 if cuda else 12)
    a.new_tokens = a.new_tokens or (128 if cuda else 8)
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        result = run(args)
    except Exception as exc:  # noqa: BLE001 - the JSON says what failed
        result = {"device": args.device, "errors": [f"{type(exc).__name__}: {exc}"],
                  "traceback": traceback.format_exc()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
