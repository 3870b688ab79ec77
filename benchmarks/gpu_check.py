"""One-command GPU check: the colocated turn on one device, speed figures, and the demo through the real driver.

In one process, timed phase by phase (docs/gpu-check.md describes each phase and JSON field): a
random-init Qwen2 of Qwen2.5-0.5B's shape (cuda) or the tiny model (cpu) is built locally; the engine
generates (tokens/s); the `Learner` recomputes the sampled tokens' logprobs (agreement with the
engine's); the engine sleeps and the learner trains (tokens/s, MFU); the weights go into the engine
through the transport the registry plans for this placement (vs a plain on-device copy of the same
bytes); peak memory per phase; then the demo task through `orchestration.driver.train` (on cuda:
`ray.placement=colocated`, one GPU, bf16). A failing phase is recorded in `errors`; the rest go on.

On a one-GPU machine (nothing is downloaded at run time):

    pip install vllm                   # optional (engine vllm); it pins a torch: install it first
    pip install torch transformers tensordict "ray[default]" datasets      # CUDA builds, if not there yet
    pip install --no-deps -e .         # this package, without its CPU pins
    python benchmarks/gpu_check.py     # --device cuda, --engine vllm if importable else transformers

On a CPU machine (the smoke run of `make test`):
`python benchmarks/gpu_check.py --device cpu --engine transformers --steps 2`. stdout gets one line,
the JSON (everything else goes to stderr); it is also written, indented, to `--out`. Exit code 1 if
any phase failed.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without install

import torch  # noqa: E402

log = logging.getLogger("gpu_check")

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)
"""Qwen2.5-0.5B's shape (494,032,768 parameters with the tied head)."""

PEAK_BF16_FLOPS = ((r"H100.*PCIe", 756e12), (r"H100 NVL", 835e12), (r"\bH100\b", 989e12), (r"\bH200\b", 989e12),
                   (r"\bA100\b", 312e12), (r"\bL4\b", 121e12), (r"\bA10G\b", 125e12))
"""Dense bf16 tensor-core FLOP/s by `torch.cuda.get_device_name()` (first match wins; vendor data sheets)."""

DEFAULTS = {  # per device: (model, requests, prompt_len, new_tokens, demo steps); None = the job's default
    "cuda": {"model": "qwen2-0.5b", "requests": 64, "prompt_len": 256, "new_tokens": 256, "steps": None},
    "cpu": {"model": "tiny", "requests": 8, "prompt_len": 16, "new_tokens": 16, "steps": 4},
}
CPU_DEMO = ("sft.steps=2", "data.eval_size=16", "data.max_operand=9", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "trainer.eval_every=0", "trainer.log_every=100",
            "trainer.call_timeout_s=120", "ray.sync_timeout_s=60")
"""The CPU smoke demo: the default job made small (the shape tests/test_ray_pipeline.py runs)."""
COLOCATED_ONE_GPU = ("ray.placement=colocated", "ray.gpus_per_replica=1", "ray.gpus_per_learner=1",
                     "model.dtype=bfloat16", "rollout.max_staleness=0")
"""One GPU shared by learner rank 0 and replica 0 (colocated mode takes turns: staleness 0)."""
GROUP = 4
"""Rows per GRPO group in the training batch (rewards are random: this is a speed figure)."""


# ---------------------------------------------------------------------------- schema
class ListOf:
    """Schema: a list whose items all match `item`."""

    def __init__(self, item):
        self.item = item


class MapOf:
    """Schema: a dict with any string keys whose values match `value`."""

    def __init__(self, value):
        self.value = value


NUM = "number"
"""Schema: an int or a float (not a bool), finite."""
_OPT_NUM = (NUM, None)
SCHEMA = {
    "device": str, "torch_version": str, "cuda_device_name": (str, None), "engine": str, "code_version": str,
    "model": ({"name": str, "params": int, "hidden_size": int, "layers": int, "vocab": int,
               "dtype": str}, None),
    "logprob_agreement": {"max_abs_diff": _OPT_NUM, "mean_abs_diff": _OPT_NUM, "tokens": (int, None), "dtype": str},
    "learner": {"tokens_per_s": _OPT_NUM, "mfu": _OPT_NUM, "step_s": _OPT_NUM, "tokens_per_step": (int, None),
                "peak_flops": _OPT_NUM},
    "generation": {"tokens_per_s": _OPT_NUM, "requests": (int, None), "new_tokens": (int, None)},
    "weight_handoff": {"transport": (str, None), "bytes": (int, None), "handoff_s": _OPT_NUM,
                       "device_copy_s": _OPT_NUM, "ratio": _OPT_NUM, "stall_s": _OPT_NUM,
                       "weights_equal": (bool, None), "version_after": (int, None),
                       "logprob_max_abs_diff_after": _OPT_NUM},
    "peak_memory_bytes": {"generate": (int, None), "train": (int, None), "handoff": (int, None)},
    "device_used_bytes": {"generate": (int, None), "train": (int, None), "handoff": (int, None)},
    "memory_source": str,
    "demo": ({"eval_reward_before": NUM, "eval_reward_after": NUM, "eval_reward_gain": NUM, "steps": int,
              "wall_s": NUM, "weight_transport": str}, None),
    "phases_s": MapOf(NUM),
    "errors": ListOf(str),
}
"""The check's JSON: every key always present (a figure a failed phase could not give is null)."""


def _matches(value, spec) -> bool:
    if spec is None:
        return value is None
    if spec is NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(spec, type):
        return isinstance(value, spec)
    if isinstance(spec, dict):
        return isinstance(value, dict)
    if isinstance(spec, ListOf):
        return isinstance(value, list)
    return isinstance(spec, MapOf) and isinstance(value, dict)


def schema_problems(value, spec=SCHEMA, path: str = "") -> list[str]:
    """Every way `value` departs from `spec` (missing or extra keys, wrong types), as 'path: problem'."""
    alternatives = spec if isinstance(spec, tuple) else (spec,)
    for alt in alternatives:
        if _matches(value, alt):
            if isinstance(alt, dict):
                out = [f"{path}{k}: missing" for k in alt if k not in value]
                out += [f"{path}{k}: not in the schema" for k in value if k not in alt]
                for k in alt:
                    if k in value:
                        out += schema_problems(value[k], alt[k], f"{path}{k}.")
                return out
            if isinstance(alt, ListOf):
                return [p for i, v in enumerate(value) for p in schema_problems(v, alt.item, f"{path}{i}.")]
            if isinstance(alt, MapOf):
                return [p for k, v in value.items() for p in schema_problems(v, alt.value, f"{path}{k}.")]
            return []
    names = [a.__name__ if isinstance(a, type) else "null" if a is None else "object" if isinstance(a, dict)
             else type(a).__name__ if not isinstance(a, str) else a for a in alternatives]
    return [f"{path.rstrip('.') or '<root>'}: expected {' or '.join(names)}, got {type(value).__name__} {value!r:.60}"]


def _nulls(spec):
    """A value of `spec` with every figure null: required objects get their keys, lists and maps are empty."""
    if isinstance(spec, dict):
        return {k: _nulls(v) for k, v in spec.items()}
    return {} if isinstance(spec, MapOf) else [] if isinstance(spec, ListOf) else None


def empty_result(device: str, engine: str) -> dict:
    """The result before any phase ran: every key of SCHEMA, figures null."""
    out = _nulls(SCHEMA)
    out.update(device=device, torch_version=torch.__version__, engine=engine, code_version=code_version(),
               memory_source="")
    out["logprob_agreement"]["dtype"] = "bfloat16" if device == "cuda" else "float32"
    return out


# ---------------------------------------------------------------------------- arguments
def _positive(kind: type):
    """An argparse type: a `kind` (int or float) > 0, else an error argparse prefixes with the flag."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} > 0, got {text!r}")
        return value
    return parse


_positive_int, _positive_float = _positive(int), _positive(float)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a bad value exits naming its flag) and device defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (default when torch sees a GPU) or cpu (the smoke run)")
    p.add_argument("--engine", choices=("auto", "transformers", "vllm"), default="auto",
                   help="auto: vllm if importable, else transformers")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="the demo's trainer.steps (default: the job's on cuda, 4 on cpu)")
    p.add_argument("--model", choices=("qwen2-0.5b", "tiny"), default=None,
                   help="speed-figure model (default: qwen2-0.5b on cuda, tiny on cpu)")
    p.add_argument("--requests", type=_positive_int, default=None, help="prompts decoded together")
    p.add_argument("--prompt-len", type=_positive_int, default=None, help="tokens per random prompt")
    p.add_argument("--new-tokens", type=_positive_int, default=None, help="tokens generated per prompt")
    p.add_argument("--train-steps", type=_positive_int, default=3, help="timed learner steps (after one warm-up)")
    p.add_argument("--peak-tflops", type=_positive_float, default=None,
                   help="the GPU's dense bf16 TFLOP/s for MFU (default: from a table by GPU name)")
    p.add_argument("--gpu-memory-utilization", type=_positive_float, default=None,
                   help="vLLM's GPU share (default: what the colocated placement sets)")
    p.add_argument("--skip-demo", action="store_true", help="no demo job (demo: null)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase-timeout-s", type=_positive_float, default=900.0,
                   help="bound of every wait on the engine, the weight sync and Ray")
    p.add_argument("--demo-timeout-s", type=_positive_float, default=3600.0, help="bound of the demo job")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"),
                   help="where the JSON is also written (indented)")
    args = p.parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            p.error("--device: torch sees no CUDA device (torch.cuda.is_available() is False); "
                    "pass --device cpu for the CPU smoke run")
        args.device = "cuda"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                "(a CPU build of torch, or no GPU visible)")
    vllm_here = importlib.util.find_spec("vllm") is not None
    if args.engine == "auto":
        args.engine = "vllm" if vllm_here else "transformers"
    elif args.engine == "vllm" and not vllm_here:
        p.error("--engine vllm: the vllm package is not installed (pip install vllm, or --engine transformers)")
    if args.gpu_memory_utilization is not None and not args.gpu_memory_utilization <= 1.0:
        p.error(f"--gpu-memory-utilization: must be in (0, 1], got {args.gpu_memory_utilization}")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------- helpers
def code_version() -> str:
    """The checkout's commit (+dirty when tracked files differ from it), or 'unknown'."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"], capture_output=True,
                               timeout=20).returncode == 1
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def peak_flops(device_name: str | None, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    for pattern, flops in PEAK_BF16_FLOPS:
        if device_name and re.search(pattern, device_name):
            return flops
    return None


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PhaseMemory:
    """Peak memory of one phase: CUDA's allocator peak of this process (reset at the phase's start), or
    on cpu this process's peak resident set (VmHWM, reset through /proc/self/clear_refs) above its
    resident set at the start."""

    def __init__(self, device: str):
        self.device = device
        self._base = 0
        if device == "cuda":
            self.source = ("torch.cuda.max_memory_allocated of this process, reset before each phase (an engine "
                           "in another process, vLLM's engine core, is not in it: see device_used_bytes)")
        elif self._reset_hwm():
            self.source = ("peak RSS of this process above its RSS at the phase's start "
                           "(VmHWM via /proc/self/clear_refs)")
        else:
            self.source = "unavailable (no writable /proc/self/clear_refs): peak memory is null"

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            return _proc_status_kib("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self._reset_hwm():
            self._base = _proc_status_kib("VmRSS") or 0

    def stop(self) -> tuple[int | None, int | None]:
        """(peak bytes of this process, bytes in use on the device by every process) since `start`."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return int(torch.cuda.max_memory_allocated()), int(total - free)
        hwm = _proc_status_kib("VmHWM")
        if hwm is None or self.source.startswith("unavailable"):
            return None, None
        return max(0, hwm - self._base) * 1024, None


def sync(device: str) -> None:
    """Wait for the device's queued work (timings of asynchronous CUDA calls); a no-op on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def device_copy_seconds(nbytes: int, device: str, repeats: int = 5) -> float:
    """Median time of one plain `copy_` of `nbytes` bytes between two buffers on `device` (synchronized)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i:  # the first copy warms the allocator and the pages up
            times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times)


def trajectory_batch(responses, generator: torch.Generator):
    """Engine responses as a trajectory batch `[N, T]` with random per-row rewards (drawn from `generator`)
    and GRPO advantages over groups of `GROUP` rows."""
    from rayllm_rl.data.trajectory import TrajectoryBuilder, concat_padded
    from rayllm_rl.objectives import AdvantageConfig, compute_advantages

    rows = []
    for i, r in enumerate(responses):
        b = TrajectoryBuilder()
        b.add_prompt(r.input_tokens)
        b.add_generated(r)
        rows.append(b.build(reward=float(torch.randn((), generator=generator)), group_id=i // GROUP))
    batch = concat_padded(rows)
    batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], AdvantageConfig())
    return batch


def logprob_abs_diff(learner, batch) -> torch.Tensor:
    """|learner - engine| logprob of every sampled token of `batch`, `[tokens]` (float32 on the CPU)."""
    lp = learner.compute_logprobs(batch).float()
    return (lp - batch["logprobs"]).abs()[batch["loss_mask"]]


def build_model_dir(name: str, workdir: Path, seed: int, dtype: torch.dtype) -> str:
    """The speed-figure model as a local HF directory: the tiny model's cache, or a random-init Qwen2 of
    Qwen2.5-0.5B's shape written with save_pretrained beside the tiny model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from rayllm_rl.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    if name == "tiny":
        return tiny
    tok = AutoTokenizer.from_pretrained(tiny)
    config = Qwen2Config(**QWEN2_05B, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    path = workdir / "qwen2-0.5b-random"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    gc.collect()
    return str(path)


def describe_model(name: str, path: str, dtype: torch.dtype) -> dict:
    """Shape and parameter count (tied weights once) from the config, on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return {"name": name, "params": int(params), "hidden_size": int(config.hidden_size),
            "layers": int(config.num_hidden_layers), "vocab": int(config.vocab_size),
            "dtype": str(dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------- the check
class GPUCheck:
    """Runs the phases in order on one event loop (the engine's), filling `result`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = args.device
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.result = empty_result(self.device, args.engine)
        self.workdir = Path(tempfile.mkdtemp(prefix="rayllm-gpucheck-"))
        self.ray_temp = f"/tmp/rayllm-gpucheck-{os.getpid()}"
        self.ray_started = False
        self.loop = asyncio.new_event_loop()
        self.memory = PhaseMemory(self.device)
        self.result["memory_source"] = self.memory.source
        self.model_path: str | None = None
        self.engine = self.learner = self.batch = None
        self.handed_over: bool | None = None
        """True once the handoff phase put the learner's weights into the awake engine."""
        self.rng = torch.Generator().manual_seed(args.seed)

    # -------------------------------------------------------------- plumbing
    def wait(self, coro, what: str):
        """Run `coro` on the check's loop, bounded by --phase-timeout-s."""
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, self.args.phase_timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} did not finish within "
                               f"--phase-timeout-s={self.args.phase_timeout_s:g}s") from None

    @contextmanager
    def phase(self, name: str, needs: tuple[str, ...] = (), memory: bool = False):
        """Time a phase; an exception is logged and recorded in `errors`, and the check goes on. `needs`:
        attributes an earlier phase must have set (else the phase is recorded as not run)."""
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            self.result["errors"].append(f"{name}: not run: an earlier phase that makes {', '.join(missing)} failed")
            yield False
            return
        log.info("phase %s ...", name)
        if memory:
            self.memory.start()
        t0 = time.perf_counter()
        try:
            yield True
        except Exception as exc:  # noqa: BLE001 - recorded, the next phases still run
            log.error("phase %s failed:\n%s", name, traceback.format_exc())
            self.result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            self.result["phases_s"][name] = round(time.perf_counter() - t0, 3)
            if memory:
                peak, used = self.memory.stop()
                self.result["peak_memory_bytes"][name] = peak
                self.result["device_used_bytes"][name] = used
            log.info("phase %s: %.1fs", name, self.result["phases_s"][name])

    def start_ray(self) -> None:
        """A local Ray of this check's own (own temp dir; the demo's driver joins it), shut down at the end."""
        import ray

        if ray.is_initialized():
            return
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 _temp_dir=self.ray_temp, log_to_driver=True,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
        self.ray_started = True

    def requests(self, n: int, new_tokens: int):
        from rayllm_rl.inference.protocol import LLMRequest, SamplingParams

        low, high = max(self.tokenizer.all_special_ids) + 1, len(self.tokenizer)  # ids past the special tokens
        prompts = torch.randint(low, high, (n, self.args.prompt_len), generator=self.rng).tolist()
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
        return [LLMRequest(input_ids=p, sampling=sampling) for p in prompts]

    def generate(self, n: int, new_tokens: int) -> tuple[list, float]:
        reqs = self.requests(n, new_tokens)

        async def go():
            return await asyncio.gather(*(self.engine.agenerate(r) for r in reqs))

        t0 = time.perf_counter()
        out = self.wait(go(), f"generating {n} x {new_tokens} tokens")
        return out, time.perf_counter() - t0

    def to_batch(self, responses):
        return trajectory_batch(responses, self.rng)

    def logprob_diff(self, batch) -> torch.Tensor:
        return logprob_abs_diff(self.learner, batch)

    # -------------------------------------------------------------- phases
    def run(self) -> dict:
        a, r = self.args, self.result
        if self.device == "cuda":
            r["cuda_device_name"] = torch.cuda.get_device_name()
        with self.phase("model") as ok:
            if ok:
                from transformers import AutoTokenizer

                self.model_path = build_model_dir(a.model, self.workdir, a.seed, self.dtype)
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                r["model"] = describe_model(a.model, self.model_path, self.dtype)
        with self.phase("generate", needs=("model_path",), memory=True) as ok:
            if ok:
                self._generate()
        with self.phase("logprobs", needs=("batch",)) as ok:
            if ok:
                self._agreement()
        with self.phase("train", needs=("learner",), memory=True) as ok:
            if ok:
                self._train()
        if self.learner is not None or not a.skip_demo:
            with self.phase("ray") as ok:  # the object store lives in Ray; the demo's driver joins this Ray
                if ok:
                    self.start_ray()
        with self.phase("handoff", needs=("learner", "engine"), memory=True) as ok:
            if ok:
                self._handoff()
        with self.phase("device_copy", needs=("learner",)) as ok:
            if ok:
                h = r["weight_handoff"]
                nbytes = sum(p.numel() * p.element_size() for p in self.learner.model.parameters())
                h["device_copy_s"] = device_copy_seconds(nbytes, self.device)
                if h["handoff_s"] is not None:
                    h["ratio"] = h["handoff_s"] / h["device_copy_s"]
        with self.phase("after_handoff", needs=("handed_over",)) as ok:
            if ok:
                self._after_handoff()
        self._release_speed_phase()
        if not a.skip_demo:
            with self.phase("demo") as ok:
                if ok:
                    self._demo()
        return r

    def _generate(self) -> None:
        from rayllm_rl.inference.registry import build_engine, placed_options

        a = self.args
        options = placed_options(a.engine, {}, colocated=self.device == "cuda")
        if a.engine == "vllm":
            options["max_model_len"] = a.prompt_len + a.new_tokens
            if a.gpu_memory_utilization is not None:
                options["gpu_memory_utilization"] = a.gpu_memory_utilization
        self.engine = build_engine(a.engine, self.model_path, seed=a.seed,
                                   dtype=str(self.dtype).removeprefix("torch."), options=options)
        self.wait(self.engine.start(), "starting the engine")
        self.generate(a.requests, a.new_tokens)  # warm-up: first batch, graphs, allocator
        responses, wall = self.generate(a.requests, a.new_tokens)
        tokens = sum(len(x.output_tokens) for x in responses)
        self.result["generation"].update(tokens_per_s=tokens / wall, requests=len(responses), new_tokens=tokens)
        self.batch = self.to_batch(responses)

    def _agreement(self) -> None:
        from rayllm_rl.learner.distributed import DistConfig
        from rayllm_rl.learner.learner import Learner, OptimConfig

        dist = DistConfig(backend="nccl") if self.device == "cuda" else None  # one GPU learner: no process group
        self.learner = Learner(self.model_path, OptimConfig(), temperature=1.0, seed=self.args.seed, dtype=self.dtype,
                               dist=dist)
        diff = self.logprob_diff(self.batch)
        self.result["logprob_agreement"].update(max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
                                                tokens=int(diff.numel()))

    def _train(self) -> None:
        """The colocated turn: the engine sleeps, the learner's state comes onto the device, it trains."""
        from rayllm_rl.objectives import GRPOLoss

        a, out = self.args, self.result["learner"]
        self.wait(self.engine.turns.sleep(1), "engine.turns.sleep")
        self.learner.onload()
        loss = GRPOLoss()
        self.learner.train_step(self.batch, loss)  # warm-up: optimizer state, kernels
        times = []
        for _ in range(a.train_steps):
            sync(self.device)
            t0 = time.perf_counter()
            metrics = self.learner.train_step(self.batch, loss)
            sync(self.device)
            times.append(time.perf_counter() - t0)
            if metrics.get("skipped_nonfinite_steps"):
                raise RuntimeError(f"a train step was skipped (non-finite loss or gradient): {metrics}")
        tokens = int(self.batch["attention_mask"].sum())
        step_s = statistics.median(times)
        flops = peak_flops(self.result["cuda_device_name"], a.peak_tflops) if self.device == "cuda" else None
        out.update(step_s=step_s, tokens_per_step=tokens, tokens_per_s=tokens / step_s, peak_flops=flops)
        if flops:
            out["mfu"] = 6 * self.result["model"]["params"] * out["tokens_per_s"] / flops

    def _handoff(self) -> None:
        """Wake the weights, sync through the planned transport, offload the learner, wake the KV cache."""
        from rayllm_rl.inference.protocol import weights_checksum
        from rayllm_rl.weight_sync import metas_to_spec
        from rayllm_rl.weight_sync.registry import make_spec, open_sender, plan_transport

        a, h = self.args, self.result["weight_handoff"]
        gpu = self.device == "cuda"
        transport = plan_transport("auto", learner_gpus=gpu, replica_gpus=gpu, learner_node="127.0.0.1",
                                   replica_nodes=["127.0.0.1"], colocated=gpu)
        if transport == "cuda_ipc" and a.engine == "transformers":
            # CUDA IPC opens a handle in another process only; this engine receives in the learner's own
            # process here (in a job it is the replica actor's), so the check hands over through the store
            transport = "object_store"
        h["transport"] = transport
        metas = self.learner.weight_metas()
        spec = make_spec(transport, metas_to_spec(metas), receivers=self.engine.weights.receiving_processes(transport),
                         timeout_s=a.phase_timeout_s, bucket_bytes=16 << 20, host="127.0.0.1")
        opened = open_sender(spec, metas)  # learner rank 0's end first: a group binds its store here
        spec = spec.with_init(opened.init)  # what the engine joins (the port rank 0 bound)

        async def setup():  # a group transport's sender waits for the receivers: finish it while they join
            sender, _ = await asyncio.gather(asyncio.to_thread(opened.finish),
                                             self.engine.weights.init_update_group(spec.for_rank(1)))
            return sender

        try:
            sender = self.wait(setup(), f"building both ends of the {transport} weight sync")
        except BaseException:
            opened.close()  # what opening bound, if finishing never started (else finishing releases it)
            raise
        try:
            self.wait(self.engine.turns.wake_up(["weights"]), "engine.turns.wake_up(weights)")
            sync(self.device)
            t0 = time.perf_counter()
            if spec.info.pulls:  # the sender publishes, the engine fetches what it was handed
                stats, handoff = sender.send(self.learner.iter_named_tensors(), 1)
                got = self.wait(self.engine.weights.receive_weights(handoff), "engine.weights.receive_weights")
            else:
                async def push():
                    return await asyncio.gather(asyncio.to_thread(sender.send, self.learner.iter_named_tensors(), 1),
                                                self.engine.weights.receive_weights(None))

                (stats, _), got = self.wait(push(), f"the {transport} weight sync")
            sync(self.device)
            h.update(handoff_s=time.perf_counter() - t0, bytes=int(stats.bytes), stall_s=float(got["stall_s"]))
            want = weights_checksum(self.learner.named_tensors())
            self.learner.offload()
            self.wait(self.engine.turns.wake_up(["kv_cache"]), "engine.turns.wake_up(kv_cache)")
            have = self.wait(self.engine.weights.weights_checksum(), "engine.weights.weights_checksum")
            h["weights_equal"] = math.isclose(want, have, rel_tol=1e-6, abs_tol=1e-6)
            if not h["weights_equal"]:
                raise RuntimeError(f"after the handoff the engine's weights differ from the learner's "
                                   f"(checksums {have!r} vs {want!r})")
            self.handed_over = True
        finally:
            sender.close()

    def _after_handoff(self) -> None:
        """A few new completions from the handed-over weights, stamped version 1, scored by the learner."""
        a, h = self.args, self.result["weight_handoff"]
        responses, _ = self.generate(min(a.requests, 8), min(a.new_tokens, 32))
        versions = {v for x in responses for v in x.output_versions}
        h["version_after"] = max(versions)
        if versions != {1}:
            raise RuntimeError(f"tokens after the handoff carry versions {sorted(versions)}, expected [1]")
        self.learner.onload()  # the learner scores them on the device it trains on
        try:
            h["logprob_max_abs_diff_after"] = float(self.logprob_diff(self.to_batch(responses)).max())
        finally:
            self.learner.offload()

    def _release_speed_phase(self) -> None:
        """Stop the engine and free the learner before the demo takes the device."""
        engine, self.engine, self.learner, self.batch = self.engine, None, None, None
        if engine is not None:
            try:
                self.wait(engine.weights.close_update_group(), "leaving the weight sync")  # its segments, its group
                self.wait(engine.aclose(), "closing the engine")
            except Exception as exc:  # noqa: BLE001 - recorded; the demo still runs
                self.result["errors"].append(f"cleanup: closing the engine: {type(exc).__name__}: {exc}")
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _demo(self) -> None:
        """The demo task through the real driver, bounded by --demo-timeout-s (run on a thread)."""
        from rayllm_rl.config import load_config
        from rayllm_rl.orchestration.driver import train
        from rayllm_rl.job.config import GRPOJobConfig
        from rayllm_rl.job.plan import make_plan

        a = self.args
        if importlib.util.find_spec("datasets") is None:
            raise RuntimeError("the demo's task loader needs the datasets package (pip install datasets)")
        overrides = [f"trainer.run_dir={self.workdir / 'demo'}", f"inference.engine={a.engine}",
                     f"ray.temp_dir={self.ray_temp}", f"trainer.seed={a.seed}"]
        overrides += list(COLOCATED_ONE_GPU) if self.device == "cuda" else list(CPU_DEMO)
        if a.steps is not None:
            overrides.append(f"trainer.steps={a.steps}")
        plan = make_plan(load_config(GRPOJobConfig, overrides))
        self.start_ray()
        box: dict = {}

        def job():
            try:
                box["summary"] = train(plan)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the waiting thread
                box["error"] = exc

        t0 = time.perf_counter()
        thread = threading.Thread(target=job, name="gpu-check-demo", daemon=True)
        thread.start()
        thread.join(a.demo_timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"the demo job did not finish within --demo-timeout-s={a.demo_timeout_s:g}s")
        if "error" in box:
            raise box["error"]
        s = box["summary"]
        self.result["demo"] = {"eval_reward_before": float(s["eval_reward_before"]),
                               "eval_reward_after": float(s["eval_reward_after"]),
                               "eval_reward_gain": float(s["eval_reward_gain"]), "steps": int(s["steps"]),
                               "wall_s": time.perf_counter() - t0, "weight_transport": str(s["weight_transport"])}

    def close(self) -> None:
        """Shut down what this check started (Ray, the loop) and remove its temp dirs; bounded, best effort."""
        if self.ray_started:
            import ray

            done = threading.Event()
            threading.Thread(target=lambda: (ray.shutdown(), done.set()), daemon=True).start()
            if not done.wait(120):
                self.result["errors"].append("cleanup: ray.shutdown did not finish within 120s")
        self.loop.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self.ray_temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # stdout carries the JSON only: everything else that writes to fd 1 (Ray's forwarded actor logs,
    # vLLM's engine core, the driver's console) goes to stderr from here on.
    json_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.device == "cuda":
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process holds CUDA before vLLM starts
    check = GPUCheck(args)
    try:
        result = check.run()
    finally:
        check.close()
    problems = schema_problems(result)
    if problems:
        result["errors"].append("schema: " + "; ".join(problems))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()
    log.info("errors: %s", result["errors"] or "none")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
