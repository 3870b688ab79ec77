"""`data.path` as a hub dataset `name[:config[:split]]`, offline, from the `datasets` cache that an
online `load_dataset` leaves (prepared here by `datasets`' own builder): a given config, the task's
default config, several configs and none given, a missing config, an offline miss, errors before Ray."""
from __future__ import annotations

import pytest

from fixtures.hub_cache import GSM8K_FIXTURE, go_offline, gsm8k_rows, publish_dataset
from rayllm_rl.data.sources import DatasetSourceError, load_rows
from rayllm_rl.envs.dataset_envs import GSM8KEnv

CHECKS = {"required": GSM8KEnv.required_fields, "check_row": GSM8KEnv.check_row}


def socratic(rows: list[dict]) -> list[dict]:
    return [{**r, "question": "Socratic: " + r["question"]} for r in rows]


@pytest.fixture()
def gsm8k_hub(tmp_path, monkeypatch) -> list[dict]:
    """openai/gsm8k with GSM8K's two configs (main, socratic), train and test splits, in the offline cache."""
    go_offline(tmp_path, monkeypatch)
    rows = gsm8k_rows()
    publish_dataset("openai/gsm8k", {"main": {"train": rows[:4], "test": rows[4:]},
                                     "socratic": {"train": socratic(rows[:3]), "test": socratic(rows[3:])}}, tmp_path)
    return rows


def build_task(tmp_path, *overrides: str):
    from rayllm_rl.config import load_config
    from rayllm_rl.orchestration.factories import build_task
    from rayllm_rl.job.config import GRPOJobConfig

    return build_task(load_config(GRPOJobConfig, [f"trainer.run_dir={tmp_path}", *overrides]).validate())


def test_config_and_split_given(gsm8k_hub):
    main = load_rows("openai/gsm8k:main", **CHECKS)
    assert main["question"] == [r["question"] for r in gsm8k_hub[:4]]
    test = load_rows("openai/gsm8k:socratic:test", **CHECKS)
    assert test["question"] == [r["question"] for r in socratic(gsm8k_hub[3:])]
    assert len(load_rows("openai/gsm8k:main", "test", **CHECKS)) == 1


def test_task_default_config_is_used_when_none_is_given(gsm8k_hub, tmp_path):
    task = build_task(tmp_path, "task=gsm8k", "data.path=openai/gsm8k", "data.eval_size=1",
                      "data.eval_path=openai/gsm8k:main:test")
    assert len(task.train) == 4 and len(task.eval) == 1
    assert sorted(task.train["question"]) == sorted(r["question"] for r in gsm8k_hub[:4])  # main, not socratic
    assert task.eval["question"] == [gsm8k_hub[4]["question"]]
    assert task.train[0]["messages"][-1]["content"].endswith(task.train[0]["question"])


def test_several_configs_and_none_given_lists_the_configs(gsm8k_hub, tmp_path):
    with pytest.raises(DatasetSourceError, match=r"data.path='openai/gsm8k'.*several configs \['main', 'socratic'\]"
                       r".*data.path=openai/gsm8k:main"):
        load_rows("openai/gsm8k", **CHECKS)
    # the math task's default config ("default") is not among them: the error lists them too
    with pytest.raises(DatasetSourceError, match=r"several configs \['main', 'socratic'\]"):
        build_task(tmp_path, "task=math", "data.path=openai/gsm8k")


def test_missing_config_and_split_name_what_exists(gsm8k_hub):
    with pytest.raises(DatasetSourceError, match=r"no config 'nope'; configs: \['main', 'socratic'\]"):
        load_rows("openai/gsm8k:nope", **CHECKS)
    with pytest.raises(DatasetSourceError, match=r"split 'validation'.*"):
        load_rows("openai/gsm8k:main:validation", **CHECKS)


def test_single_config_dataset_loads_without_a_config(tmp_path, monkeypatch):
    go_offline(tmp_path, monkeypatch)
    rows = gsm8k_rows()
    publish_dataset("someone/gsm8k-mini", {"default": {"train": rows}}, tmp_path)
    task = build_task(tmp_path, "task=gsm8k", "data.path=someone/gsm8k-mini", "data.eval_size=2")
    assert len(task.train) == 3 and len(task.eval) == 2


def test_offline_miss_names_the_id_and_the_cache(tmp_path, monkeypatch):
    home = go_offline(tmp_path, monkeypatch)
    with pytest.raises(DatasetSourceError, match=rf"hub dataset 'someorg/absent'; datasets cache "
                       rf"{home}/datasets/someorg___absent; offline mode on"):
        load_rows("someorg/absent", **CHECKS)


def test_a_missing_config_fails_before_any_actor_starts(gsm8k_hub, tmp_path):
    import ray

    from rayllm_rl.config import load_config
    from job_helpers import run_job
    from rayllm_rl.job.config import GRPOJobConfig

    assert not ray.is_initialized()
    cfg = load_config(GRPOJobConfig, ["task=gsm8k", "data.path=openai/gsm8k:nope", "trainer.backend=ray",
                                      f"trainer.run_dir={tmp_path}"]).validate()
    with pytest.raises(DatasetSourceError, match=r"'openai/gsm8k:nope'.*configs: \['main', 'socratic'\]"):
        run_job(cfg)
    assert not ray.is_initialized(), "the error came before Ray (and so any actor) started"


def test_env_worker_task_holds_no_dataset_and_its_env_takes_the_given_row(tokenizer):
    """Env workers get rows, not paths: their task has no dataset and its env is fed each row."""
    import torch
    from tensordict import NonTensorData, TensorDict

    from rayllm_rl.envs.dataset_tasks import make_gsm8k
    from rayllm_rl.job.config import DataConfig

    task = make_gsm8k(DataConfig(path=str(GSM8K_FIXTURE), eval_size=1)).worker_part()
    assert task.train is None and task.eval is None
    env = task.make_env(tokenizer, seed=0)
    row = gsm8k_rows()[1]
    elem = TensorDict(batch_size=[])
    elem["row"] = NonTensorData(dict(row))
    elem["messages"] = NonTensorData(env.messages_of(row))
    elem["group_id"] = torch.tensor(7)
    obs = env.reset(elem.unsqueeze(0))
    assert obs[0]["row"]["question"] == row["question"]
    assert row["question"] in env.messages_of(row)[-1]["content"]
    with pytest.raises(ValueError, match="holds no dataset"):
        env.reset()


@pytest.mark.parametrize("source", ["hub", "file"])
def test_task_datasets_pickle_their_rows_not_cache_paths(gsm8k_hub, tmp_path, source):
    """Ray pickles `task.train` for the collector, maybe on another node: the pickle must carry the rows.
    A dataset backed by arrow files in the driver's `datasets` cache pickles as their paths only."""
    import pickle
    import shutil

    from fixtures.hub_cache import GSM8K_FIXTURE

    path = "openai/gsm8k" if source == "hub" else str(GSM8K_FIXTURE)
    task = build_task(tmp_path, "task=gsm8k", f"data.path={path}", "data.eval_size=1")
    cache = tmp_path / "hf_home" / "datasets"
    rows = {"train": task.train.to_list(), "eval": task.eval.to_list()}
    assert len(rows["train"]) == (3 if source == "hub" else 4) and len(rows["eval"]) == 1
    blobs = {k: pickle.dumps(getattr(task, k)) for k in rows}
    assert cache.is_dir() and all(str(cache).encode() not in b for b in blobs.values())
    shutil.rmtree(cache)  # what another node's collector sees: no such cache
    for k, blob in blobs.items():
        back = pickle.loads(blob)
        assert back.to_list() == rows[k]
        assert back[0]["messages"][-1]["content"].endswith(rows[k][0]["question"])


def test_an_empty_eval_split_pickles_without_cache_paths(tmp_path, monkeypatch):
    import pickle

    from fixtures.hub_cache import GSM8K_FIXTURE

    home = go_offline(tmp_path, monkeypatch)
    task = build_task(tmp_path, "task=gsm8k", f"data.path={GSM8K_FIXTURE}", "data.eval_size=0")
    assert len(task.train) == 5 and len(task.eval) == 0 and task.eval.column_names == ["question", "answer"]
    assert str(home).encode() not in pickle.dumps(task.eval) + pickle.dumps(task.train)


def test_an_eval_source_naming_no_split_reads_the_test_split(gsm8k_hub, tmp_path):
    task = build_task(tmp_path, "task=gsm8k", "data.path=openai/gsm8k", "data.eval_path=openai/gsm8k")
    assert task.eval["question"] == [gsm8k_hub[4]["question"]]  # main:test, 1 row (main:train has 4)
    assert len(task.train) == 4
    task = build_task(tmp_path, "task=gsm8k", "data.path=openai/gsm8k", "data.eval_path=openai/gsm8k:socratic")
    assert task.eval["question"] == [r["question"] for r in socratic(gsm8k_hub[3:])]  # socratic:test


@pytest.mark.parametrize("path, eval_path", [
    ("openai/gsm8k", "openai/gsm8k:main:train"),  # the task's default config is main: the same rows
    ("openai/gsm8k:main:test", "openai/gsm8k"),  # trains on test, and eval reads test
    ("openai/gsm8k:socratic", "openai/gsm8k:socratic:train"),
    ("FILE", "FILE"),
])
def test_an_eval_source_with_the_training_rows_is_refused(gsm8k_hub, tmp_path, path, eval_path):
    from fixtures.hub_cache import GSM8K_FIXTURE

    path, eval_path = (str(GSM8K_FIXTURE) if p == "FILE" else p for p in (path, eval_path))
    with pytest.raises(ValueError, match=rf"data.eval_path='{eval_path}' and data.path='{path}' .*same rows.*"
                       r"training rows"):
        build_task(tmp_path, "task=gsm8k", f"data.path={path}", f"data.eval_path={eval_path}")
    # another config or split is fine
    build_task(tmp_path, "task=gsm8k", "data.path=openai/gsm8k", "data.eval_path=openai/gsm8k:socratic:train")
