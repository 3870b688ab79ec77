"""`benchmarks/vs_trl.py`'s bookkeeping (issue AB) on hand-made inputs: the RL clock less the evaluations, the
back-to-back order, the time to target and its target, the table's refusal to mix machines, days or contended
runs, and the contention sampler against busy processes whose CPU time they report themselves."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import machine  # noqa: E402
import vs_trl  # noqa: E402
import vs_trl_table  # noqa: E402


def test_our_clock_takes_each_evaluation_off_and_the_curve_ends_on_the_final_score(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    recs = [{"phase": "eval", "step": 0, "time_s": 10.0, "eval_reward": 0.1},
            {"phase": "rl", "step": 1, "time_s": 30.0, "reward": 0.2, "wait_s": 5.0, "eval_reward": 0.2, "eval_s": 4.0},
            {"phase": "rl", "step": 2, "time_s": 50.0, "reward": 0.3, "wait_s": 1.0},
            {"phase": "rl", "step": 3, "time_s": 80.0, "reward": 0.4, "wait_s": 3.0, "eval_reward": 0.4, "eval_s": 6.0},
            {"phase": "rl", "step": 4, "time_s": 95.0, "reward": 0.5, "wait_s": 2.0},
            {"phase": "eval", "step": 4, "time_s": 120.0, "eval_reward": 0.45}]
    metrics.write_text("\n".join(map(json.dumps, recs)))
    loop = vs_trl.rl_loop(metrics, before=0.1, after=0.45)
    # step 1 at 30 - 10 - 4; step 3 at 80 - 10 - (4 + 6); the end at 95 - 10 - 10, scored by the final eval
    assert loop["curve"] == [[0, 0.0, 0.1], [1, 16.0, 0.2], [3, 60.0, 0.4], [4, 75.0, 0.45]]
    assert loop["rl_seconds"] == 75.0 and loop["eval_seconds"] == [4.0, 6.0]
    assert loop["rewards"] == [0.2, 0.3, 0.4, 0.5]
    assert loop["wait_after_eval_s"] == statistics.fmean([1.0, 2.0])  # steps 2 and 4 follow an evaluation
    assert loop["wait_other_s"] == 3.0  # step 3 (step 1 waits for the first batch: left out)


def test_each_side_runs_first_second_and_last_once_over_three_seeds():
    args = vs_trl.parse_args(["--task", "chain_sum,basic_arithmetic", "--engine", "transformers,vllm"])
    order = vs_trl.run_order(args)
    assert len(order) == 3 * 2 * 3
    for task in ("chain_sum", "basic_arithmetic"):
        for seed in (0, 1, 2):  # a seed's sides run back to back
            block = [(side, eng) for s, t, side, eng in order if s == seed and t == task]
            assert len(block) == 3
        positions = {}
        for seed in (0, 1, 2):
            block = [(side, eng) for s, t, side, eng in order if s == seed and t == task]
            for i, side in enumerate(block):
                positions.setdefault(side, []).append(i)
        assert all(sorted(p) == [0, 1, 2] for p in positions.values()), positions
    # a table made in parts turns as the whole one does: the turn is the seed's number
    parts = [o for seeds in ("0", "1,2") for o in vs_trl.run_order(vs_trl.parse_args(
        ["--task", "chain_sum,basic_arithmetic", "--engine", "transformers,vllm", "--seeds", seeds]))]
    assert parts == order
    # each task's own steps and cadence, unless given
    assert args.task_steps == {"chain_sum": 6, "basic_arithmetic": 12}
    assert args.task_eval_every == {"chain_sum": 1, "basic_arithmetic": 2}
    assert vs_trl.parse_args(["--task", "chain_sum", "--steps", "9"]).task_steps == {"chain_sum": 9}
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--steps", "chain_sums=6"])


def run(seed, after, curve, info, contended=False, **kw):
    return {"seed": seed, "eval_before": 0.15, "eval_after": after, "gain": after - 0.15, "steps": 6,
            "gain_per_step": (after - 0.15) / 6, "sequences_per_s": 1.0, "gain_per_rl_second": (after - 0.15) / 100,
            "curve": curve, "machine": info, "contention": {"contended": contended}, **kw}


INFO = {"date": "2026-12-06T03:00:00+00:00", "cpu_model": "Xeon", "kernel_flags": ["avx2", "avx512f"],
        "torch_cpu_capability": "AVX512", "cores": 2}


def test_time_to_target_from_the_lower_sides_mean_less_its_standard_error():
    ours_after, trl_after = [0.50, 0.52, 0.54], [0.46, 0.48, 0.53]
    runs = {("cs", "ours", s): run(s, a, [[0, 0, 0.15], [2, 50.0, 0.30], [4, 100.0, 0.47], [6, 150.0, a]], INFO)
            for s, a in enumerate(ours_after)}
    runs |= {("cs", "trl", s): run(s, a, [[0, 0, 0.15], [2, 80.0, 0.35], [4, 160.0, 0.40], [6, 240.0, a]], INFO)
             for s, a in enumerate(trl_after)}
    tab = vs_trl_table.summarize(runs)["cs"]
    mean = sum(trl_after) / 3  # TRL's is the lower mean: 0.49
    se = math.sqrt(sum((a - mean) ** 2 for a in trl_after) / 2) / math.sqrt(3)
    assert tab["target"]["side"] == "trl" and tab["target"]["target"] == pytest.approx(mean - se)
    target = mean - se  # 0.4686...
    # ours: 0.47 at 100 s on every seed; TRL: only its final points, 240 s, reach it, and the 0.46 seed never does
    assert tab["ours"]["time_to_target_s"] == [100.0, 100.0, 100.0]
    assert tab["trl"]["time_to_target_s"] == [None, 240.0, 240.0] and tab["trl"]["reached"] == "2/3"
    assert 0.46 < target < 0.47
    assert tab["ours"]["vs_trl"]["times_sooner"] is None  # not every TRL run reached it: no ratio
    for s in range(3):  # TRL above the target at its step 4 (160 s) on every seed: the same target
        runs[("cs", "trl", s)]["curve"][2][2] = 0.52
    tab = vs_trl_table.summarize(runs)["cs"]
    assert tab["target"]["target"] == pytest.approx(target) and tab["trl"]["time_to_target_s"] == [160.0] * 3
    assert tab["trl"]["all_reached"] and tab["ours"]["vs_trl"]["times_sooner"] == pytest.approx(160.0 / 100.0)
    assert tab["eval_before_equal_across_sides"]
    assert "target" in vs_trl_table.markdown(vs_trl_table.summarize(runs))


def write(tmp_path, name, runs_by_label):
    path = tmp_path / name
    path.write_text(json.dumps({"runs": {"cs": runs_by_label}}))
    return str(path)


def test_the_table_refuses_other_machines_other_days_unrecorded_and_contended_runs(tmp_path):
    curve = [[0, 0, 0.15], [6, 100.0, 0.5]]
    a = write(tmp_path, "a.json", {"ours": [run(0, 0.5, curve, INFO)], "trl": [run(0, 0.5, curve, INFO)]})
    assert vs_trl_table.load_runs([a], None)[2] == []
    avx2 = {**INFO, "kernel_flags": ["avx2"], "torch_cpu_capability": "AVX2"}
    b = write(tmp_path, "b.json", {"trl": [run(1, 0.5, curve, avx2)]})
    assert "2 machines" in vs_trl_table.load_runs([a, b], None)[2][0]
    later = {**INFO, "date": "2026-12-08T03:00:00+00:00"}
    c = write(tmp_path, "c.json", {"trl": [run(1, 0.5, curve, later)]})
    assert "more than a day" in vs_trl_table.load_runs([a, c], None)[2][0]
    d = write(tmp_path, "d.json", {"trl": [run(1, 0.5, curve, None)]})
    assert "record no machine" in vs_trl_table.load_runs([a, d], None)[2][0]
    e = write(tmp_path, "e.json", {"ours": [run(1, 0.5, curve, INFO)],
                                   "trl": [run(1, 0.5, curve, INFO, contended=True)]})
    assert "contended" in vs_trl_table.load_runs([a, e], None)[2][0]
    assert vs_trl_table.load_runs([a, e], None, keep_contended=True)[2] == []
    rerun = write(tmp_path, "f.json", {"trl": [run(1, 0.5, curve, INFO)]})  # its rerun replaces it
    runs, replaced, problems = vs_trl_table.load_runs([a, e, rerun], None)
    assert problems == [] and replaced == [["cs", "trl", 1, e, rerun]]
    with pytest.raises(SystemExit, match="do not make one table"):
        vs_trl_table.main(["--files", a, b, "--out", str(tmp_path / "t.json")])
    # a side with a seed the others lack: refused, unless its task is left out
    g = write(tmp_path, "g.json", {"ours": [run(1, 0.5, curve, INFO)]})
    assert vs_trl_table.load_runs([a, g], None)[2] == [
        "cs: the sides ran other seeds (ours [0, 1], trl [0]): run the missing ones, or leave the task out (--tasks)"]
    assert vs_trl_table.load_runs([a, g], None, tasks={"other"}) == ({}, [], [])


BUSY = ("import time, sys\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
        "print(time.process_time())")


def test_contention_counts_marked_processes_as_ours_and_the_rest_as_others(monkeypatch):
    monkeypatch.setenv(machine.MARK, "a-test")
    interval = 0.2
    with machine.Contention("a-test", interval_s=interval) as c:
        ours = subprocess.Popen([sys.executable, "-c", BUSY.format(s=1.5)], stdout=subprocess.PIPE, text=True)
        env = {k: v for k, v in os.environ.items() if k != machine.MARK}
        other = subprocess.Popen([sys.executable, "-c", BUSY.format(s=1.0)], stdout=subprocess.PIPE, text=True, env=env)
        ours_cpu, other_cpu = (float(p.communicate(timeout=120)[0]) for p in (ours, other))
    rep = c.report()
    # each child is counted from its start to the last sample that saw it: at most one interval (plus its
    # interpreter's exit) short; nothing else on the machine is counted as ours
    assert ours_cpu - interval - 0.3 <= rep["ours_cpu_s"], (rep, ours_cpu)
    assert other_cpu - interval - 0.3 <= rep["other_cpu_s"], (rep, other_cpu)
    assert rep["ours_cpu_s"] <= ours_cpu + 0.5 + c.wall_s  # the child, plus this process's own sampling thread
    assert rep["other_share"] == pytest.approx(c.other_s / (c.wall_s * os.cpu_count()), abs=1e-4)
    assert rep["contended"] == (rep["other_share"] > machine.CONTENDED)


def test_machine_info_records_the_cpu_kernels_threads_packages_and_commit():
    info = machine.machine_info()
    assert info["cpu_model"] and info["cores"] == os.cpu_count() and info["torch_threads"] >= 1
    assert info["torch_cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "NO AVX", "ZVECTOR", "VSX"}
    assert info["versions"]["torch"] and info["versions"]["rayllm_rl"]
    assert info["commit"] is None or len(info["commit"]) == 40
    assert machine.same_machine([info, dict(info)]) == []
    assert len(info["code_digest"]) == 16


def test_the_table_refuses_other_packages_and_other_code(tmp_path):
    info = {**INFO, "versions": {"torch": "2.13.0", "trl": "1.16.0"}, "code_digest": "a" * 16}
    assert machine.same_machine([info, dict(info)]) == []
    newer_trl = {**info, "versions": {"torch": "2.13.0", "trl": "1.17.0"}}
    assert machine.same_machine([info, newer_trl]) == ["2 sets of package versions (differing: trl)"]
    other_code = {**info, "code_digest": "b" * 16}
    assert machine.same_machine([info, other_code]) == [f"2 versions of the code (code_digest {'a' * 16}, {'b' * 16})"]
    unrecorded = {k: v for k, v in info.items() if k != "code_digest"}  # made before the digest was recorded
    assert machine.same_machine([info, unrecorded]) == []
    # the digest follows the bytes of the code a run executes, edits included, and nothing else
    for top in machine.CODE:
        (tmp_path / top).mkdir()
    (tmp_path / "rayllm_rl" / "loss.py").write_text("x = 1\n")
    (tmp_path / "rayllm_rl" / "notes.md").write_text("a doc\n")
    first = machine.code_digest(tmp_path)
    (tmp_path / "rayllm_rl" / "notes.md").write_text("another doc\n")
    assert machine.code_digest(tmp_path) == first
    (tmp_path / "rayllm_rl" / "loss.py").write_text("x = 2\n")
    assert machine.code_digest(tmp_path) != first
