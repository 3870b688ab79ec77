"""The table of `benchmarks/vs_trl.py` results kept in several files (one per seed, side or engine, as the runs
were made): per task and side, each seed's gain, and the mean and min-max over the seeds of the gain, gain per
step, sequences/s and gain per RL second, with ours / TRL ratios of the means.

Runs are keyed by (task, side label, seed); a run in a later file replaces the same key from an earlier one (a
rerun), and the replaced ones are listed in the output. `--sides` keeps only the labels given (default: every
label in the files).

Run (the table in docs/performance.md, "Against TRL"):
  .venv/bin/python benchmarks/vs_trl_table.py --files benchmarks/results/vs_trl_shared_*.json ...
The last stdout line is the JSON (also written to `--out`); the markdown table is printed before it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

FIELDS = ("gain", "gain_per_step", "sequences_per_s", "gain_per_rl_second")


def load_runs(files: list[str], sides: set[str] | None) -> tuple[dict, list]:
    """{(task, label, seed): run}, and [(task, label, seed, replaced file, by file)]."""
    runs: dict[tuple, dict] = {}
    origin: dict[tuple, str] = {}
    replaced = []
    for f in files:
        data = json.loads(Path(f).read_text())
        for task, by_label in data["runs"].items():
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
    return runs, replaced


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def table(runs: dict) -> dict:
    """{task: {label: {"seeds": [...], "gains": [...], field: stats}}}."""
    out: dict = {}
    for (task, label, seed), run in sorted(runs.items()):
        side = out.setdefault(task, {}).setdefault(label, {"seeds": [], "runs": []})
        side["seeds"].append(seed)
        side["runs"].append(run)
    for task, sides in out.items():
        for label, side in sides.items():
            for field in FIELDS:
                side[field] = stats([float(r[field]) for r in side["runs"]])
            side["gains"] = [round(float(r["gain"]), 4) for r in side["runs"]]
            side["steps"] = sorted({int(r["steps"]) for r in side["runs"]})
            del side["runs"]
        trl = sides.get("trl")
        for label, side in sides.items():
            if trl is not None and label != "trl":
                side["vs_trl"] = {f: side[f]["mean"] / trl[f]["mean"] if trl[f]["mean"] else None
                                  for f in ("gain_per_step", "sequences_per_s", "gain_per_rl_second")}
    return out


def markdown(tab: dict) -> str:
    lines = ["| task | side (its --ours-set in the JSON) | seeds | steps | gain per seed | gain, mean (min-max) | gain / step | sequences/s | "
             "gain / RL s | ours / TRL: per step, per RL s |", "|" + "---|" * 10]
    for task, sides in tab.items():
        for label, s in sides.items():
            def cell(f, fmt):
                return f"{s[f]['mean']:{fmt}} ({s[f]['min']:{fmt}} to {s[f]['max']:{fmt}})"
            ratio = (f"{s['vs_trl']['gain_per_step']:.2f}x, {s['vs_trl']['gain_per_rl_second']:.2f}x"
                     if s.get("vs_trl") else "")
            lines.append(f"| {task} | {label.split('[')[0]} | {','.join(map(str, s['seeds']))} | {','.join(map(str, s['steps']))} | "
                         f"{' / '.join(f'{g:+.3f}' for g in s['gains'])} | {cell('gain', '+.3f')} | "
                         f"{cell('gain_per_step', '.4f')} | {cell('sequences_per_s', '.2f')} | "
                         f"{cell('gain_per_rl_second', '.1e')} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", nargs="+", required=True, help="vs_trl.py result files, earlier first")
    p.add_argument("--sides", nargs="*", default=[], help="side labels to keep (default: all)")
    p.add_argument("--out", default="benchmarks/results/vs_trl_table.json")
    args = p.parse_args(argv)
    runs, replaced = load_runs(args.files, set(args.sides) or None)
    tab = table(runs)
    result = {"files": args.files, "sides": args.sides, "replaced": replaced, "table": tab}
    print(markdown(tab))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
