"""A bad config on the command line is one message naming the key, not a traceback (issue AB, item 7).

`jobs/grpo.py`, `python -m rayllm_rl train|dry-run` (the `rayllm-rl` command): a config error found before the
job starts (loading, validation, the plan) ends the process with a short message on stderr and exit status 1,
before Ray starts or any weights load (`cli.job_main`); `RAYLLM_DEBUG=1` shows the traceback. An override that
merges into a mapping a config file set is told how to replace it (`~key` first). An error once the job has
started keeps its traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "config=recipes/smollm2-135m_reasoning-gym_cpu.yaml"
OPTIONS = "data.reasoning_gym.options"

PROBE = """\
import atexit, json, runpy, sys

def said():  # on stdout once the process ends (SystemExit included): did the job start?
    ray = sys.modules.get("ray")
    print(json.dumps({"ray_initialized": bool(ray is not None and ray.is_initialized()),
                      "driver_imported": "rayllm_rl.orchestration.driver" in sys.modules}))

atexit.register(said)
target, sys.argv = sys.argv[1], sys.argv[1:]
if target == "-m":
    sys.argv = ["rayllm_rl", *sys.argv[1:]]
    runpy.run_module("rayllm_rl", run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""
"""`python -c PROBE jobs/grpo.py ARGS` runs `python jobs/grpo.py ARGS` (`-m rayllm_rl ARGS`: `python -m rayllm_rl
ARGS`) and says at exit whether Ray was started or the driver (which loads the weights) imported."""


def env(**extra: str) -> dict[str, str]:
    # reasoning-gym imports a package (cellpylib) whose source has SyntaxWarnings, printed on every import where no
    # bytecode is written (PYTHONDONTWRITEBYTECODE, as in this repo's test runs): not ours to count as a line
    return {**os.environ, "PYTHONWARNINGS": "ignore::SyntaxWarning", "HF_HUB_OFFLINE": "1", **extra}


def start(*argv: str, probe: bool = True, **extra_env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", PROBE, *argv] if probe else [sys.executable, *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


BAD = {  # the command line -> what its message must say (the key, and for the mapping merge the way out)
    "unknown key": (("jobs/grpo.py", "trainer.bogus=1"), ["unknown config key 'trainer.bogus'"]),
    "bad Literal value": (("-m", "dry-run", "trainer.backend=loca"),
                          ["config key 'trainer.backend': 'loca' is not one of ('ray', 'local')"]),
    "bad type": (("-m", "train", "rollout.group_size=abc"), ["config key 'rollout.group_size': expected an int"]),
    "options merged into the recipe's": (
        ("jobs/grpo.py", RECIPE, "data.reasoning_gym.dataset=gcd", f"{OPTIONS}={{max_value: 12}}"),
        [f"{OPTIONS}.min_terms: gcd has no such option",  # the recipe's chain_sum option the merge kept
         f"hint: {OPTIONS}={{max_value: 12}} was merged into the {OPTIONS} that {RECIPE} set ({{'min_terms': 2, "
         "'max_terms': 2, 'min_digits': 1, 'max_digits': 2}), whose entries stay",
         f"unset it first: '~{OPTIONS}' '{OPTIONS}={{max_value: 12}}'"]),  # how to replace the mapping
}
"""Run as processes (`jobs/grpo.py`, `python -m rayllm_rl train|dry-run`): each imports torch, seconds apiece."""

IN_PROCESS = {  # more of them, through the same handler in this process (`job_main(..., say_config_errors=True)`)
    "bad mapping text": ([f"{OPTIONS}={{max_value: 12"], [f"config key '{OPTIONS}': '{{max_value: 12' is not a YAML"]),
    "a field's own check": (["rollout.top_p=2"], ["rollout.top_p must be in (0, 1]"]),
    "a bound": (["rollout.top_k=-1"], ["rollout.top_k=-1: must be >= 0"]),
    "cross-field rule": (["trainer.backend=local", "inference.engine=vllm"],
                         ["inference.engine=vllm runs in Ray replica actors: set trainer.backend=ray"]),
    "a task's options": ([RECIPE, f"{OPTIONS}.max_terms=1"],
                         ["are refused by chain_sum: max_terms must be >= min_terms", f"'~{OPTIONS}'"]),
    "no such recipe": (["config=recipe:cpu_dmo"], ["config=recipe:cpu_dmo: no such recipe (close: ['cpu_demo'])"]),
    "a flag-less stray word": (["12}"], ["override '12}' must look like key.sub=value"]),
}

LAST_LINE = "  (nothing was started; RAYLLM_DEBUG=1 shows the traceback)"


def check_message(code, err: str, texts: list[str]) -> None:
    """Exit status 1, no traceback, a few lines: `config error: ...` first, the texts in it."""
    assert code == 1, (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[0].startswith("config error: ") and len(lines) <= 3 and lines[-1] == LAST_LINE, err
    for text in texts:
        assert text in err, err


@pytest.fixture(scope="module")
def said():
    """Every command line of BAD, run at once."""
    procs = {name: start(*argv) for name, (argv, _) in BAD.items()}
    return {name: finish(proc) for name, proc in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD))
def test_a_config_error_is_one_short_message_naming_the_key_before_anything_starts(said, name):
    code, out, err = said[name]
    check_message(code, err, BAD[name][1])
    started = json.loads(out.strip().splitlines()[-1])
    assert started == {"ray_initialized": False, "driver_imported": False}, started


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_every_config_error_before_the_start_is_said_the_same_way(capsys, name):
    from rayllm_rl.cli import job_main

    argv, texts = IN_PROCESS[name]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        job_main(argv, say_config_errors=True)
    check_message(exited.value.code, capsys.readouterr().err, texts)


def test_the_hints_command_line_replaces_the_mapping(capsys):
    from rayllm_rl.cli import job_main

    plan = job_main([RECIPE, "data.reasoning_gym.dataset=gcd", f"~{OPTIONS}", f"{OPTIONS}={{max_value: 12}}",
                     "--dry-run", "--json"], say_config_errors=True)
    assert plan["data"]["train"]["source"] == "reasoning-gym gcd {'max_value': 12}", plan["data"]


def test_rayllm_debug_shows_the_traceback(monkeypatch):
    from rayllm_rl.cli import job_main
    from rayllm_rl.config import ConfigError

    monkeypatch.setenv("RAYLLM_DEBUG", "1")
    with pytest.raises(ConfigError, match="unknown config key 'trainer.bogus'"):
        job_main(["trainer.bogus=1"], say_config_errors=True)


@pytest.mark.slow
def test_in_process_callers_get_the_exception_and_an_error_after_the_start_keeps_its_own(tmp_path):
    """`job_main` without `say_config_errors` (the docs' checker, a notebook) raises the config error itself; with
    it, an error once the job has started (here: the driver resolving a model that is not there, a ValueError too)
    is raised as it is, traceback and all, not said as a config error."""
    from rayllm_rl.cli import job_main
    from rayllm_rl.config import ConfigError
    from rayllm_rl.hub import HubResolutionError

    with pytest.raises(ConfigError, match="unknown config key 'trainer.bogus'"):
        job_main(["trainer.bogus=1"])
    missing = tmp_path / "no-model"
    with pytest.raises(HubResolutionError, match="is neither an existing local directory nor a hub id"):
        job_main(["trainer.backend=local", f"model.path={missing}", f"trainer.run_dir={tmp_path / 'runs'}"],
                 say_config_errors=True)


def test_the_hint_names_only_mappings_a_config_file_set_and_the_error_is_about():
    from rayllm_rl.cli import config_error_message
    from rayllm_rl.config import merged_mappings
    from rayllm_rl.job.config import GRPOJobConfig

    chain_sum = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    one_key = f"{OPTIONS}.max_value=12"
    assert merged_mappings(GRPOJobConfig, [RECIPE, one_key]) == {OPTIONS: (chain_sum, [one_key])}
    assert merged_mappings(GRPOJobConfig, [RECIPE, f"~{OPTIONS}", one_key]) == {}  # unset first: replaced
    assert merged_mappings(GRPOJobConfig, [one_key]) == {}  # no file set it: nothing was kept
    about = config_error_message(ValueError(f"{OPTIONS}.min_terms: gcd has no such option"), [RECIPE, one_key])
    assert f"unset it first: '~{OPTIONS}' {one_key}" in about, about
    other = config_error_message(ValueError("rollout.top_p must be in (0, 1]"), [RECIPE, one_key])
    assert "hint" not in other and len(other.splitlines()) == 2, other
