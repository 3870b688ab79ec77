"""Experiment trackers (`trackers.loggers`): TensorBoard, W&B (offline) and MLflow (local file store) log the
same scalars and the config as metrics.jsonl; each is read back from its own files. A tracker that fails is
reported, dropped, and the run goes on."""
from __future__ import annotations

import glob
import json
import math
import os
import struct
import time
from pathlib import Path

import pytest

from rayllm_rl import tracking
from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig, TrackersConfig
from rayllm_rl.orchestration.reporting import RunReporter

ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """W&B must never need a login or the network: no key, an unreachable server, offline from the config only."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any attempt to reach a server would fail
    for key in ("MLFLOW_ALLOW_FILE_STORE",):
        monkeypatch.delenv(key, raising=False)


# --- readers: each tracker's files, read back with that tracker's own tools -------------------------------

def read_jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_tensorboard(run_dir: Path) -> tuple[dict[str, dict[int, float]], str]:
    """{tag: {step: value}} of the scalars, and the config text, from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    text_tag = next(t for t in acc.Tags()["tensors"] if t.startswith("config"))
    text = acc.Tensors(text_tag)[0].tensor_proto.string_val[0].decode()
    return scalars, text


def _wandb_records(path: str):
    """The protobuf Records of a .wandb file: W&B's header (':W&B', magic, version: 7 bytes), then LevelDB's
    log format (32 KiB blocks of chunks: crc32c, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of a block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
        else:
            assert kind in (2, 3), kind


def read_wandb(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict]:
    """{'<phase>/<field>': {step: value}} (the step from '<phase>/step', each phase's x-axis) and the config,
    from the offline run's .wandb file."""
    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    series: dict[str, dict[int, float]] = {}
    config: dict = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            phase_steps = [k for k in row if k.endswith("/step")]
            assert len(phase_steps) == 1, row
            phase, step = phase_steps[0][:-len("/step")], row[phase_steps[0]]
            for k, v in row.items():
                if k.startswith(phase + "/") and k != phase_steps[0]:
                    series.setdefault(k, {})[step] = v
    return series, config


def read_mlflow(run_dir: Path, experiment: str = "rayllm_rl") -> tuple[dict[str, dict[int, float]], dict, str]:
    """{key: {step: value}}, the params and the run's status, through MlflowClient on the run's file store."""
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    [run] = client.search_runs([exp.experiment_id])
    series = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
              for key in run.data.metrics}
    return series, run.data.params, run.info.status


def expected_series(records: list[dict]) -> dict[str, dict[int, float]]:
    """What every scalar tracker must hold, from metrics.jsonl: numeric fields at the record's step."""
    steps, out = tracking.StepCounter(), {}
    for r in records:
        if r.get("phase") == "tracker_dropped":
            continue
        step = steps(r)
        for k, v in tracking.scalars(r).items():
            out.setdefault(f"{r.get('phase', 'run')}/{k}", {})[step] = v
    return out


def assert_same(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], rel: float) -> None:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for key, by_step in want.items():
        assert set(got[key]) == set(by_step), key
        for step, value in by_step.items():
            if math.isnan(value):
                assert math.isnan(got[key][step]), (key, step)
            else:
                assert got[key][step] == pytest.approx(value, rel=rel, abs=1e-12), (key, step)


CONFIG = {"trainer": {"steps": 3, "run_dir": "x"}, "trackers": {"loggers": ALL}, "optim": {"lr": 1e-6},
          "long": "v" * 7000, "model": {"path": ""}}


def driver_like_records() -> list[dict]:
    """A handful of records shaped like the driver's: SFT steps, eval, RL steps with lists and None, a stop."""
    out = [{"phase": "sft", "sft_step": k, "loss": 5.8 - 0.1 * k, "lr": 5e-5 * k} for k in (1, 2, 3)]
    out.append({"phase": "eval", "step": 0, "eval_reward": 0.25, "eval_n": 16.0})
    for k in (1, 2, 3):
        out.append({"phase": "rl", "step": k, "version": k, "reward": 0.1 * k + 0.0123, "loss": -0.01 * k,
                    "token_versions": [k - 1], "data_sha": "abc", "tokens_per_s": None if k == 1 else 400.5 + k,
                    "staleness_max": 0, "truncated": True})
    out.append({"phase": "stop", "stopped": "trainer.time_budget_s cut RL", "at": 3})
    return out


def test_each_tracker_reads_back_the_same_scalars_and_config_as_metrics_jsonl(tmp_path):
    t0 = time.perf_counter()
    reporter = RunReporter(str(tmp_path), config=CONFIG, trackers=TrackersConfig(loggers=ALL))
    for record in driver_like_records():
        reporter.log(record)
    reporter.close()
    run_dir = reporter.run_dir
    assert reporter.trackers.dropped == [] and reporter.trackers.names() == []  # all closed, none dropped
    records = read_jsonl(run_dir)
    assert len(records) == 8 and records[4]["token_versions"] == [0] and records[4]["data_sha"] == "abc"
    want = expected_series(records)
    assert want["rl/reward"] == pytest.approx({1: 0.1123, 2: 0.2123, 3: 0.3123})
    assert want["sft/loss"] == pytest.approx({1: 5.7, 2: 5.6, 3: 5.5})
    assert want["stop/at"] == {0: 3.0} and want["rl/tokens_per_s"] == {2: 402.5, 3: 403.5}
    assert "rl/token_versions" not in want and "rl/data_sha" not in want and "rl/truncated" not in want

    tb, tb_config = read_tensorboard(run_dir)
    assert_same(tb, want, rel=1e-6)  # TensorBoard keeps float32
    assert "| trainer.steps | 3 |" in tb_config and "| optim.lr | 1e-06 |" in tb_config

    wb, wb_config = read_wandb(run_dir)
    assert_same(wb, want, rel=0)
    assert wb_config["trainer.steps"] == 3 and wb_config["trackers.loggers"] == ALL and wb_config["optim.lr"] == 1e-6

    ml, params, status = read_mlflow(run_dir)
    assert_same(ml, want, rel=0)
    assert status == "FINISHED"
    assert params["trainer.steps"] == "3" and params["optim.lr"] == "1e-06"
    assert params["trackers.loggers"] == json.dumps(ALL) and len(params["long"]) == 6000  # MLflow's limit
    assert time.perf_counter() - t0 < 60


class _Raises(tracking.Tracker):
    """A fake tracker to reach the failure paths: raises on its 3rd record, or hangs on close."""

    name = "mlflow"
    logged: list[int] = []

    def __init__(self, run_dir, options, hang_on_close=False):
        self.hang = hang_on_close

    def log_config(self, flat):
        pass

    def log(self, phase, values, step, wall_time):
        type(self).logged.append(step)
        if len(type(self).logged) == 3:
            raise ConnectionError("tracking server went away")

    def close(self):
        if self.hang:
            time.sleep(30)


def test_a_tracker_that_raises_mid_run_is_dropped_and_the_others_keep_logging(tmp_path, monkeypatch, capsys):
    _Raises.logged = []
    monkeypatch.setitem(tracking.TRACKER_CLASSES, "mlflow", _Raises)
    reporter = RunReporter(str(tmp_path), config=CONFIG,
                           trackers=TrackersConfig(loggers=["jsonl", "tensorboard", "mlflow"]))
    for record in driver_like_records():
        reporter.log(record)
    reporter.close()
    assert _Raises.logged == [1, 2, 3]  # never called again once it raised
    err = capsys.readouterr().err
    assert err.count("tracker 'mlflow' failed during log and is dropped") == 1 and "tracking server went away" in err
    records = read_jsonl(reporter.run_dir)
    dropped = [r for r in records if r["phase"] == "tracker_dropped"]
    assert [(d["tracker"], d["during"]) for d in dropped] == [("mlflow", "log")]
    assert reporter.trackers.dropped == [{"tracker": "mlflow", "during": "log",
                                          "error": "ConnectionError: tracking server went away"}]
    tb, _ = read_tensorboard(reporter.run_dir)
    assert_same(tb, expected_series(records), rel=1e-6)  # TensorBoard kept every record, before and after


def test_a_tracker_that_fails_to_start_or_hangs_on_close_is_dropped_within_the_timeout(tmp_path, monkeypatch, capsys):
    def fails_at_start(run_dir, options):
        raise ImportError("no module named wandb")

    monkeypatch.setitem(tracking.TRACKER_CLASSES, "wandb", fails_at_start)
    monkeypatch.setitem(tracking.TRACKER_CLASSES, "mlflow", lambda d, o: _Raises(d, o, hang_on_close=True))
    _Raises.logged = []
    trackers = TrackersConfig(loggers=["tensorboard", "wandb", "mlflow"], timeout_s=0.5)
    reporter = RunReporter(str(tmp_path), config=CONFIG, trackers=trackers)
    reporter.log({"phase": "rl", "step": 1, "reward": 0.5})
    t0 = time.perf_counter()
    reporter.close()
    assert time.perf_counter() - t0 < 5  # the hung close was abandoned after 0.5 s, not waited 30 s
    assert [(d["tracker"], d["during"]) for d in reporter.trackers.dropped] == [("wandb", "start"), ("mlflow", "close")]
    assert "did not return within 0.5s" in reporter.trackers.dropped[1]["error"]
    err = capsys.readouterr().err
    assert "tracker 'wandb' failed during start" in err and "tracker 'mlflow' failed during close" in err
    assert not (reporter.run_dir / "metrics.jsonl").exists()  # jsonl was not asked for
    [rl] = [r for r in reporter.records if r["phase"] == "rl"]
    assert read_tensorboard(reporter.run_dir)[0] == {"rl/reward": {1: 0.5},
                                                      "rl/time_s": {1: pytest.approx(rl["time_s"])}}


def test_loggers_config_parses_lists_and_rejects_unknown_names(tmp_path):
    base = ["trainer.backend=local", f"trainer.run_dir={tmp_path}"]
    assert load_config(GRPOJobConfig, base).validate().trackers.loggers == ["jsonl"]
    cfg = load_config(GRPOJobConfig, [*base, "trackers.loggers=[jsonl,tensorboard,wandb,mlflow]"]).validate()
    assert cfg.trackers.loggers == ALL
    assert load_config(GRPOJobConfig, [*base, "trackers.loggers=tensorboard"]).trackers.loggers == ["tensorboard"]
    with pytest.raises(ValueError,
                       match=r"trackers\.loggers=\['jsonl', 'neptune'\]: unknown logger\(s\) \['neptune'\]"):
        load_config(GRPOJobConfig, [*base, "trackers.loggers=[jsonl,neptune]"]).validate()
    with pytest.raises(ValueError, match=r"trackers\.loggers.*\['wandb'\] named more than once"):
        load_config(GRPOJobConfig, [*base, "trackers.loggers=wandb,wandb"]).validate()
    with pytest.raises(ValueError, match=r"trackers\.timeout_s=0\.0: must be > 0"):
        load_config(GRPOJobConfig, [*base, "trackers.timeout_s=0"])
    cfg = GRPOJobConfig()
    cfg.trackers.timeout_s = -1.0  # set from Python: the field's limit is checked by validate()
    with pytest.raises(ValueError, match=r"trackers\.timeout_s=-1\.0: must be > 0"):
        cfg.validate()


@pytest.mark.parametrize("old, new", [
    ("trainer.loggers", "trackers.loggers"), ("trainer.wandb_project", "trackers.wandb_project"),
    ("trainer.wandb_mode", "trackers.wandb_mode"), ("trainer.mlflow_tracking_uri", "trackers.mlflow_tracking_uri"),
    ("trainer.mlflow_experiment", "trackers.mlflow_experiment"), ("trainer.tracker_timeout_s", "trackers.timeout_s"),
])
def test_a_tracker_key_of_the_trainer_section_fails_naming_its_new_key(old, new, tmp_path):
    from rayllm_rl.config import ConfigError

    with pytest.raises(ConfigError, match=f"config key '{old}' moved to '{new}'"):
        load_config(GRPOJobConfig, [f"{old}=x"])
    (tmp_path / "job.yaml").write_text(f"trainer:\n  {old.split('.')[1]}: x\n")  # the same from YAML
    with pytest.raises(ConfigError, match=f"moved to '{new}'"):
        load_config(GRPOJobConfig, [f"config={tmp_path / 'job.yaml'}"])


@pytest.mark.slow
def test_a_short_job_logs_to_all_four_trackers_offline(small_job_cfg):
    from job_helpers import run_job

    cfg = small_job_cfg("trainer.backend=local", "sft.steps=3", "trainer.steps=3", "trainer.eval_every=2",
                        "trainer.call_timeout_s=600", "trackers.loggers=[jsonl,tensorboard,wandb,mlflow]",
                        "trackers.mlflow_experiment=arith").validate()
    summary = run_job(cfg)
    run_dir = Path(summary["run_dir"])
    records = read_jsonl(run_dir)
    assert not [r for r in records if r["phase"] == "tracker_dropped"]
    want = expected_series(records)
    assert set(want["rl/entropy"]) == {1, 2, 3} and set(want["sft/loss"]) == {1, 2, 3}
    # mid-run eval: in the RL record
    assert set(want["eval/eval_reward"]) == {0, 3} and set(want["rl/eval_reward"]) == {2}
    tb, tb_config = read_tensorboard(run_dir)
    assert_same(tb, want, rel=1e-6)
    assert "| trackers.loggers | [\"jsonl\", \"tensorboard\", \"wandb\", \"mlflow\"] |" in tb_config
    wb, wb_config = read_wandb(run_dir)
    assert_same(wb, want, rel=0)
    assert wb_config["trainer.steps"] == 3 and wb_config["rollout.group_size"] == 4
    ml, params, status = read_mlflow(run_dir, "arith")
    assert_same(ml, want, rel=0)
    assert status == "FINISHED" and params["trainer.backend"] == "local"
