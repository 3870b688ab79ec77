"""Results that outlive the job (storage.py): a relative `trainer.run_dir` and `resume=` resolve
against one storage root (trainer.storage_root, $RAYLLM_STORAGE_ROOT, ~/rayllm_results in an uploaded working
dir, else the directory the job started from), never against Ray's temporary copy of a job's working dir."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig
from rayllm_rl.storage import (JOB_DEFAULT_ROOT, RAY_JOB_CONFIG_ENV, STORAGE_ENV, in_uploaded_working_dir,
                                             storage_root, with_resolved_paths)

UPLOADED = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0123abcd"
"""Where Ray unpacks a job's `--working-dir` (ray/_private/runtime_env/working_dir.py)."""
JOB_ENV = {RAY_JOB_CONFIG_ENV: json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123abcd.zip"},
                                           "metadata": {}})}
"""What Ray's job supervisor gives a `ray job submit --working-dir .` entrypoint (job_supervisor.py)."""


def test_the_root_is_the_key_then_the_variable_then_the_jobs_default_then_the_start_directory(tmp_path):
    home = str(Path(JOB_DEFAULT_ROOT).expanduser())
    assert storage_root("/data/r", cwd="/w", environ={STORAGE_ENV: "/env/r", **JOB_ENV}).path == Path("/data/r")
    assert storage_root("~/r", cwd="/w", environ={}).path == Path("~/r").expanduser()
    got = storage_root("", cwd="/w", environ={STORAGE_ENV: "/env/r", **JOB_ENV})
    assert (got.path, got.source) == (Path("/env/r"), f"${STORAGE_ENV}")
    for cwd, environ in ((UPLOADED, {}), ("/anywhere", JOB_ENV), (UPLOADED, JOB_ENV)):
        got = storage_root("", cwd=cwd, environ=environ)
        assert str(got.path) == home and "temporary copy of its working dir" in got.source, (cwd, environ)
    got = storage_root("", cwd=str(tmp_path), environ={})
    assert (got.path, got.source) == (tmp_path, "the directory the job started from")
    # a job submitted without a working dir runs where it was started: that directory is no temporary copy
    plain = {RAY_JOB_CONFIG_ENV: json.dumps({"runtime_env": {}, "metadata": {}})}
    assert not in_uploaded_working_dir("/shared/checkout", plain) and not in_uploaded_working_dir("/w", {})
    assert not in_uploaded_working_dir("/w", {RAY_JOB_CONFIG_ENV: "not json"})


@pytest.mark.parametrize("configured,environ,message", [
    ("runs", {}, r"trainer.storage_root='runs': a storage root must be an absolute path"),
    ("", {STORAGE_ENV: "rel/dir"}, r"\$RAYLLM_STORAGE_ROOT='rel/dir': a storage root must be an absolute path"),
])
def test_a_relative_root_fails_naming_where_it_was_set(configured, environ, message):
    with pytest.raises(ValueError, match=message):
        storage_root(configured, cwd="/w", environ=environ)


def test_a_relative_storage_root_fails_at_config_time(monkeypatch):
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"trainer.storage_root='out': a storage root must be an absolute path"):
        load_config(GRPOJobConfig, ["trainer.storage_root=out"]).validate(environment=False)
    monkeypatch.setenv(STORAGE_ENV, "out")  # the variable is this machine's: checked where the job runs
    load_config(GRPOJobConfig, []).validate(environment=False)
    with pytest.raises(ValueError, match=r"\$RAYLLM_STORAGE_ROOT='out'"):
        load_config(GRPOJobConfig, []).validate()


def test_paths_resolve_under_the_root_and_absolute_ones_stay(tmp_path):
    root = storage_root(str(tmp_path))
    cfg = load_config(GRPOJobConfig, ["trainer.run_dir=runs/a", "resume=runs/a/1/checkpoints/step_2"])
    resolved, used = with_resolved_paths(cfg, root)
    assert used is root and resolved.trainer.run_dir == str(tmp_path / "runs" / "a")
    assert resolved.resume == str(tmp_path / "runs/a/1/checkpoints/step_2")
    assert cfg.trainer.run_dir == "runs/a"  # the caller's config is left as it was
    kept, _ = with_resolved_paths(load_config(GRPOJobConfig, ["trainer.run_dir=/abs/x"]), root)
    assert kept.trainer.run_dir == "/abs/x" and kept.resume == ""


def test_the_dry_run_says_where_the_results_go(tmp_path, monkeypatch, capsys):
    from rayllm_rl.cli import job_main

    monkeypatch.setenv(STORAGE_ENV, str(tmp_path / "store"))
    plan = job_main(["trainer.run_dir=runs/demo", "resume=runs/demo/x/checkpoints/step_4", "--dry-run", "--json"])
    assert plan["results"] == {"run_dir": f"{tmp_path}/store/runs/demo/<stamp>", "storage_root": f"{tmp_path}/store",
                               "source": f"${STORAGE_ENV}",
                               "resume": f"{tmp_path}/store/runs/demo/x/checkpoints/step_4"}
    capsys.readouterr()
    job_main(["trainer.run_dir=runs/demo", "--dry-run"])
    assert f"results: {tmp_path}/store/runs/demo/<stamp> (storage root {tmp_path}/store: ${STORAGE_ENV})" \
        in capsys.readouterr().out


@pytest.mark.slow
def test_a_job_in_an_uploaded_working_dir_writes_under_the_root_and_resume_finds_its_checkpoint_there(
        tmp_path, monkeypatch, capfd):
    """A job whose working dir is Ray's temporary copy (as `ray job submit --working-dir .` runs it) writes its run
    under ~/rayllm_results, not in that copy; its last line before the summary says where. A second job, started
    anywhere, resumes from a checkpoint named relative to the same root."""
    from job_helpers import run_job

    home, copy = tmp_path / "home", tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    copy.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(copy)
    small = ["trainer.backend=local", "sft.steps=2", "data.eval_size=4", "data.max_operand=9", "trainer.steps=2",
             "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "trainer.eval_every=0",
             "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", "trainer.run_dir=runs/grpo"]
    first = run_job(load_config(GRPOJobConfig, small).validate())
    run = Path(first["run_dir"])
    assert run.parent == home / "rayllm_results" / "runs" / "grpo" and (run / "summary.json").is_file()
    assert list(copy.iterdir()) == []  # nothing in the temporary copy
    assert json.loads((run / "config.json").read_text())["trainer"]["run_dir"] == str(run.parent)
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == (f"results: {run} (summary.json, metrics.jsonl, checkpoints/; storage root "
                       f"{home}/rayllm_results: {JOB_DEFAULT_ROOT} (this job runs in Ray's temporary copy of its "
                       f"working dir; set trainer.storage_root or ${STORAGE_ENV} to choose))"), err[-3:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = (run / "checkpoints" / "step_1").relative_to(home / "rayllm_results")
    resumed = run_job(load_config(GRPOJobConfig, [*small, f"resume={relative}",
                                                f"trainer.storage_root={home}/rayllm_results"]).validate())
    rl = [json.loads(x) for x in (Path(resumed["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl if r["phase"] == "rl"] == [2] and resumed["version"] == 2
    assert Path(resumed["run_dir"]).parent == run.parent and list(elsewhere.iterdir()) == []
