"""The package as users install it: a wheel built from this checkout, installed into a new virtual environment
that reuses this one's packages (its dependencies), then driven through its own command line from a folder
outside the checkout: `rayllm-rl --help`, a recipe's dry run by name, one training step, and
`python -m rayllm_rl view` on that step's run directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "rayllm_rl")
"""What the build reads: the wheel is built from a copy of these, so the checkout gets no build/ or egg-info."""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, its bin dir, the wheel): the wheel built without build isolation (offline), installed with
    no dependencies into a venv whose site-packages point at this environment's by a .pth file."""
    root = tmp_path_factory.mktemp("package")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(
            ROOT / name, src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--wheel-dir", str(root / "dist"), str(src)], cwd=root)
    wheel, = (root / "dist").glob("rayllm_rl-*.whl")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=root).stdout.strip())
    (purelib / "_reuse_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: the checkout's editable rayllm_rl, seen through the .pth, is neither removed nor reused
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--ignore-installed", "-q", str(wheel)], cwd=root)
    return python, venv / "bin", wheel


def run(cmd, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out


def user_env() -> dict[str, str]:
    """This environment without the checkout on PYTHONPATH: what runs is the installed wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def test_the_wheel_carries_the_command_the_recipes_the_license_and_one_version(installed):
    import rayllm_rl

    _, _, wheel = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist = f"rayllm_rl-{rayllm_rl.__version__}.dist-info"
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
        metadata = z.read(f"{dist}/METADATA").decode()
    recipes = {p.name for p in (ROOT / "rayllm_rl" / "recipes").glob("*.yaml")}
    assert len(recipes) >= 5 and {f"rayllm_rl/recipes/{r}" for r in recipes} <= names
    assert {"rayllm_rl/py.typed", "rayllm_rl/cli.py", "rayllm_rl/__main__.py"} <= names
    assert any(n.startswith(f"{dist}/") and "LICENSE" in n for n in names), sorted(n for n in names if "dist-info" in n)
    assert "rayllm-rl = rayllm_rl.cli:main" in entry_points
    assert f"Version: {rayllm_rl.__version__}\n" in metadata


@pytest.mark.slow
def test_the_installed_command_helps_plans_a_recipe_by_name_trains_and_views(installed, tmp_path):
    python, bin_dir, _ = installed
    env = user_env()
    where = run([python, "-c", "import rayllm_rl; print(rayllm_rl.__file__)"], cwd=tmp_path, env=env).stdout.strip()
    assert Path(where).is_relative_to(python.parent.parent), where  # the wheel's copy, not the checkout's

    helped = run([bin_dir / "rayllm-rl", "--help"], cwd=tmp_path, env=env).stdout
    assert all(command in helped for command in ("train", "dry-run", "view", "recipes"))
    listed = run([bin_dir / "rayllm-rl", "recipes"], cwd=tmp_path, env=env).stdout
    assert "config=recipe:cpu_demo" in listed and "config=recipe:smollm2-135m_reasoning-gym_cpu" in listed

    plan = json.loads(run([bin_dir / "rayllm-rl", "dry-run", "--json", "config=recipe:cpu_demo"], cwd=tmp_path,
                          env=env).stdout.strip().splitlines()[-1])
    assert plan["task"] == "arithmetic" and plan["model"]["path"] == "(built-in tiny Qwen2)", sorted(plan)
    wrong = subprocess.run([str(bin_dir / "rayllm-rl"), "dry-run", "config=recipe:cpu_dmo"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "no such recipe (close: ['cpu_demo'])" in wrong.stderr, wrong.stderr[-2000:]

    trained = run([bin_dir / "rayllm-rl", "train", "trainer.backend=local", "trainer.steps=1", "sft.steps=0",
                   "data.eval_size=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                   "rollout.max_new_tokens=4", "trainer.eval_every=0", f"trainer.run_dir={tmp_path / 'runs'}"],
                  cwd=tmp_path, env=env, timeout=400)
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and Path(summary["run_dir"]).parent == tmp_path / "runs"
    page = run([python, "-m", "rayllm_rl", "view", summary["run_dir"]], cwd=tmp_path, env=env).stdout.strip()
    assert page == (Path(summary["run_dir"]) / "trace.html").resolve().as_uri()
    assert (Path(summary["run_dir"]) / "trace.html").stat().st_size > 1000
