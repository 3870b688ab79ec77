"""The table of `benchmarks/vs_trl.py` results: per task and side, each seed's gain, and the mean and min-max over the
seeds of the gain, gain per step, sequences/s, gain per RL second and time to target, with ours / TRL ratios.

`summarize` is also what `vs_trl.py` prints at the end of a run; this script merges result files (a run in a
later file replaces the same (task, side, seed) from an earlier one: a rerun, listed in the output). A table mixes
no machines and no days: files whose runs record other CPUs, other kernels or dates more than a day apart are
refused (`benchmarks/machine.py: same_machine`), and so are runs without a machine record (made before
2026-12-06) and tasks whose sides ran other seeds (`--tasks` leaves a task out). A run flagged `contended`
(another process took over 5% of the machine while it ran) is refused unless a rerun of it replaces it or
`--keep-contended` keeps it, marked, beside its rerun.

Time to target, per task: the target is the lower of the sides' mean final held-out scores minus that side's
standard error over its seeds (sample std / sqrt(seeds)); a run's time to target is the RL seconds at the first
evaluation of its curve at or above the target (None: never reached). A side's mean is over its runs that reached
it, and the ours / TRL ratio of time to target ("x sooner") is given only where every run of both reached it.

Run (the table in docs/performance.md, "Against TRL"):
  .venv/bin/python benchmarks/vs_trl_table.py --files benchmarks/results/vs_trl_backtoback.json \
      benchmarks/results/vs_trl_backtoback_2.json benchmarks/results/vs_trl_backtoback_rerun.json --tasks chain_sum
The last stdout line is the JSON (also written to `--out`); the markdown table is printed before it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import same_machine  # noqa: E402

FIELDS = ("gain", "gain_per_step", "sequences_per_s", "gain_per_rl_second")


def load_runs(files: list[str], sides: set[str] | None, keep_contended: bool = False,
              tasks: set[str] | None = None) -> tuple[dict, list, list]:
    """({(task, label, seed): run}, [(task, label, seed, replaced file, by file)], [problems]): a problem is a
    reason the files cannot make one table (another machine or day, a run without its machine, a contended run
    that no rerun replaced, a task whose sides ran other seeds: a side's mean over fewer seeds is not beside the
    others'). `sides` and `tasks` keep only those labels and tasks."""
    runs: dict[tuple, dict] = {}
    origin: dict[tuple, str] = {}
    replaced, problems = [], []
    for f in files:
        data = json.loads(Path(f).read_text())
        for task, by_label in data["runs"].items():
            if tasks and task not in tasks:
                continue
            for label, seed_runs in by_label.items():
                if sides and label not in sides:
                    continue
                for run in seed_runs:
                    if run.get("error"):
                        continue
                    key = (task, label, int(run["seed"]))
                    if key in runs:
                        replaced.append([*key, origin[key], f])
                    runs[key], origin[key] = {**run, "file": f}, f
    infos = [r.get("machine") for r in runs.values()]
    if any(i is None for i in infos):
        problems.append(f"{sum(i is None for i in infos)} run(s) record no machine (made before the machine was "
                        f"recorded): they cannot be placed beside the others")
    problems += same_machine([i for i in infos if i is not None])
    contended = [k for k, r in runs.items() if (r.get("contention") or {}).get("contended")]
    if contended and not keep_contended:
        problems.append("contended runs (another process took over 5% of the machine), rerun them: "
                        + ", ".join(f"{t} {lbl} seed {s}" for t, lbl, s in contended))
    seeds: dict[str, dict[str, set]] = {}
    for task, label, seed in runs:
        seeds.setdefault(task, {}).setdefault(label, set()).add(seed)
    for task, by_label in sorted(seeds.items()):
        if len({frozenset(v) for v in by_label.values()}) > 1:
            problems.append(f"{task}: the sides ran other seeds (" + ", ".join(
                f"{label} {sorted(v)}" for label, v in sorted(by_label.items())) + "): run the missing ones, or "
                "leave the task out (--tasks)")
    return runs, replaced, problems


def stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "se": statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None}


def first_reach(curve: list, target: float) -> float | None:
    """The RL seconds of the first point [step, seconds, score] of `curve` whose score is at least `target`."""
    return next((float(t) for _, t, score in curve if score >= target), None)


def target_of(finals: dict[str, list[float]]) -> dict:
    """The lower of the sides' mean final scores minus that side's standard error over its seeds."""
    means = {label: statistics.fmean(v) for label, v in finals.items() if v}
    lower = min(means, key=means.get)
    n = len(finals[lower])
    se = statistics.stdev(finals[lower]) / math.sqrt(n) if n > 1 else 0.0
    return {"target": means[lower] - se, "side": lower, "its_mean": means[lower], "its_se": se}


def summarize(runs: dict) -> dict:
    """{task: {"target": ..., "eval_before_equal_across_sides": bool, label: {seeds, gains, field stats,
    time_to_target, vs_trl}}} from {(task, label, seed): run}."""
    out: dict = {}
    for (task, label, seed), run in sorted(runs.items()):
        side = out.setdefault(task, {}).setdefault(label, {"seeds": [], "runs": []})
        side["seeds"].append(seed)
        side["runs"].append(run)
    for task, sides in out.items():
        target = target_of({label: [r["eval_after"] for r in s["runs"]] for label, s in sides.items()})
        before: dict = {}
        for label, side in sides.items():
            for r in side["runs"]:
                before.setdefault(r["seed"], set()).add(r["eval_before"])
            for field in FIELDS:
                side[field] = stats([float(r[field]) for r in side["runs"] if r.get(field) is not None])
            times = [first_reach(r.get("curve") or [], target["target"]) for r in side["runs"]]
            side["time_to_target_s"] = [None if t is None else round(t, 1) for t in times]
            side["reached"] = f"{sum(t is not None for t in times)}/{len(times)}"
            side["time_to_target"] = stats([t for t in times if t is not None])
            side["all_reached"] = all(t is not None for t in times)
            side["gains"] = [round(float(r["gain"]), 4) for r in side["runs"]]
            side["steps"] = sorted({int(r["steps"]) for r in side["runs"]})
            side["contended_seeds"] = [r["seed"] for r in side["runs"] if (r.get("contention") or {}).get("contended")]
            del side["runs"]
        trl = sides.get("trl")
        for label, side in sides.items():
            if trl is not None and label != "trl":
                side["vs_trl"] = {f: side[f]["mean"] / trl[f]["mean"] if side[f] and trl[f] and trl[f]["mean"]
                                  else None for f in ("gain_per_step", "sequences_per_s", "gain_per_rl_second")}
                both = side["all_reached"] and trl["all_reached"] and side["time_to_target"]["mean"] > 0
                side["vs_trl"]["times_sooner"] = (trl["time_to_target"]["mean"] / side["time_to_target"]["mean"]
                                                  if both else None)  # 0 s: the target is at or below the start
        sides["target"] = target
        sides["eval_before_equal_across_sides"] = all(len(v) == 1 for v in before.values())
    return out


def markdown(tab: dict) -> str:
    lines = ["| task, steps | side | gain per seed | gain, mean (min to max) | gain / step | sequences/s | "
             "gain / RL s | time to target, s (per seed) | ours / TRL: per step, per RL s, x sooner |",
             "|" + "---|" * 9]
    for task, sides in tab.items():
        for label, s in sides.items():
            if label in ("target", "eval_before_equal_across_sides"):
                continue

            def cell(f, fmt):
                return f"{s[f]['mean']:{fmt}} ({s[f]['min']:{fmt}} to {s[f]['max']:{fmt}})" if s[f] else "-"
            v = s.get("vs_trl")
            ratio = ", ".join("-" if v[f] is None else f"{v[f]:.2f}x"
                              for f in ("gain_per_step", "gain_per_rl_second", "times_sooner")) if v else ""
            ttt = " / ".join("-" if t is None else f"{t:.0f}" for t in s["time_to_target_s"])
            mean_ttt = f"{s['time_to_target']['mean']:.0f}" if s["time_to_target"] else "-"
            lines.append(f"| {task}, {','.join(map(str, s['steps']))} | {label.split('[')[0]} | "
                         f"{' / '.join(f'{g:+.3f}' for g in s['gains'])} | {cell('gain', '+.3f')} | "
                         f"{cell('gain_per_step', '.4f')} | {cell('sequences_per_s', '.2f')} | "
                         f"{cell('gain_per_rl_second', '.1e')} | {mean_ttt} ({ttt}; {s['reached']}) | {ratio} |")
        t = sides["target"]
        lines.append(f"| {task}: target {t['target']:.3f} | ({t['side'].split('[')[0]}'s mean {t['its_mean']:.3f} "
                     f"- SE {t['its_se']:.3f}) | | | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", nargs="+", required=True, help="vs_trl.py result files, earlier first")
    p.add_argument("--sides", nargs="*", default=[], help="side labels to keep (default: all)")
    p.add_argument("--tasks", nargs="*", default=[], help="tasks to keep (default: all)")
    p.add_argument("--keep-contended", action="store_true",
                   help="keep contended runs (marked in the table) instead of refusing the files")
    p.add_argument("--out", default="benchmarks/results/vs_trl_table.json")
    args = p.parse_args(argv)
    runs, replaced, problems = load_runs(args.files, set(args.sides) or None, args.keep_contended,
                                         set(args.tasks) or None)
    if problems:
        raise SystemExit("vs_trl_table: these runs do not make one table:\n  " + "\n  ".join(problems))
    tab = summarize(runs)
    code = sorted({(r["machine"].get("commit"), r["machine"].get("tree_edited"), r["machine"].get("code_digest"))
                   for r in runs.values()}, key=str)  # what ran: commits, edited trees, code digests
    first = min((r["machine"] for r in runs.values()), key=lambda m: m.get("date") or "")
    machine = {k: first.get(k) for k in ("cpu_model", "cpu_vendor", "cpu_family_model", "kernel_flags",
                                         "torch_cpu_capability", "cores", "mem_total", "platform", "versions")}
    result = {"files": args.files, "sides": args.sides, "tasks": args.tasks, "replaced": replaced,
              "machine": machine,  # the one every run shares (`same_machine` refused any other), for this file alone
              "dates": sorted({r["machine"].get("date") for r in runs.values()}, key=str),
              "code": [dict(zip(("commit", "tree_edited", "code_digest"), c)) for c in code], "table": tab}
    print(markdown(tab))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
