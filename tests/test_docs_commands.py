"""Docs that run (issue S): every command in the bash blocks of README.md and docs/*.md is checked against the code.

- A job (`python jobs/grpo.py ARGS`, `rayllm-rl train|dry-run ARGS`, `jobs/submit_local.py ARGS`, the job inside
  `ray job submit ... -- ...`) is planned by the real command line (`--dry-run --json`, in this process, with
  the recipes' hub models' configs in an offline HF cache): a renamed key, a bad value, a missing recipe or file
  fails. A job that plans GPUs must say so on its line: `# needs: GPU...` (the marker the test reads).
- A script (benchmarks/, examples/, launch/, `python -m rayllm_rl.<module>`) gets its arguments parsed by its
  own argparse parser (the script is run up to its `parse_args` and stopped there): a renamed flag fails.
- `make TARGET` names a target of the Makefile; `pip install` names extras pyproject.toml declares; `rayllm-rl
  COMMAND` names a command the CLI has (`--help`, `recipes` and `version` are run).
- Anything else (sbatch, kubectl, docker, `ray start`, a cloud CLI) cannot run here: its line must carry
  `# needs: <what>` (a cluster, Slurm, Kubernetes, ...).
The checker itself is tested on broken snippets, so a broken command in the docs fails this test.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import runpy
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(bash|sh|shell)\n(.*?)^```", re.S | re.M)
INTERPRETERS = {"python", "python3", ".venv/bin/python", "$PY"}
JOB_SCRIPTS = {"jobs/grpo.py", "jobs/submit_local.py"}
NEEDS = re.compile(r"\bneeds:\s*(\S.*)$")


@dataclasses.dataclass
class Command:
    where: str
    """`file:line` of the command's first line."""
    text: str
    argv: list[str]
    comment: str
    """The line's trailing comment (where a `# needs:` marker goes)."""
    problem: str | None = None
    """Wrong as shell text, found while reading it."""

    @property
    def needs(self) -> str | None:
        m = NEEDS.search(self.comment)
        return m.group(1) if m else None


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at the first `#` outside quotes that follows a blank."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def doc_commands(text: str, name: str) -> list[Command]:
    """The commands of `text`'s bash blocks: backslash-continued lines joined (their comments kept), each line
    split at `&&`, `;` and `|` into commands that share its comment."""
    out = []
    for block in BLOCK.finditer(text):
        first_line = text[:block.start(2)].count("\n") + 1
        pending, comments, start, broken = "", [], 0, None
        for offset, raw in enumerate(block.group(2).splitlines()):
            code, comment = split_comment(raw)
            if not pending:
                start = first_line + offset
            comments += [comment] if comment else []
            if code.endswith("\\"):
                if comment:  # `cmd \  # note`: the backslash escapes a blank, and the newline ends the command
                    broken = (f"line {first_line + offset}: a comment after the line-continuing backslash ends "
                              "the command")
                pending += code[:-1] + " "
                continue
            line, pending = pending + code, ""
            if not line.strip():
                comments = []
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            tokens, parts = list(lexer), [[]]
            for tok in tokens:
                if tok in ("&&", ";", "|", "||"):
                    parts.append([])
                else:
                    parts[-1].append(tok)
            for argv in filter(None, parts):
                out.append(Command(f"{name}:{start}", line.strip(), argv, " ".join(comments), broken))
            comments, broken = [], None
    return out


class Parsed(Exception):
    """Raised by the patched `parse_args` once a script's parser accepted the arguments."""


def parse_script_args(target: str, args: list[str], module: bool = False) -> str | None:
    """Run the script (or `-m` module) up to its argparse `parse_args` with `args`; None when its parser accepts
    them, else what it said."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, argv=None, namespace=None):
        real(self, argv if argv is not None else args, namespace)
        raise Parsed

    err, old_argv = io.StringIO(), sys.argv
    sys.argv = [target, *args]
    argparse.ArgumentParser.parse_args = parse
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(str(ROOT / target), run_name="__main__")
    except Parsed:
        return None
    except SystemExit as exc:
        return f"its parser refused {args}: {err.getvalue().strip()[-400:] or exc}"
    except Exception as exc:  # noqa: BLE001 - a script that reads its arguments some other way
        return (f"it does not parse its arguments with argparse (it ran and raised {type(exc).__name__}: {exc}); "
                "mark the line `# needs: <what it needs>`")
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = old_argv
    return "it ran to the end without parsing arguments with argparse"


def plan_job(args: list[str]) -> tuple[dict | None, str | None]:
    """The job's dry-run plan (JSON), or what the command line said instead."""
    from rayllm_rl.cli import job_main

    args = [a for a in args if a not in ("--dry-run", "--json", "...")]  # `...`: "and your other settings"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            plan = job_main([*args, "--dry-run", "--json"])
    except SystemExit as exc:
        if exc.code in (0, None) and {"-h", "--help"} & set(args):
            return {"total_gpus": 0}, None  # the help, printed
        return None, f"SystemExit: {exc}"[:600]
    except Exception as exc:  # noqa: BLE001 - said as the command's problem
        return None, f"{type(exc).__name__}: {exc}"[:600]
    return plan, None


def check(cmd: Command) -> str | None:
    """None when `cmd` matches the code (module docstring), else the problem."""
    if cmd.problem:
        return cmd.problem
    argv = list(cmd.argv)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value before the command
        argv.pop(0)
    if not argv or argv[0] in ("cd", "export", "source", "git", "mkdir", "echo", "cat", "ls"):
        return None  # the shell's own steps
    head = argv[0]
    if head in INTERPRETERS and len(argv) > 2 and argv[1] == "-m":
        module, args = argv[2], argv[3:]
        if module == "rayllm_rl":
            return check(dataclasses.replace(cmd, argv=["rayllm-rl", *args]))
        if module == "pytest":
            return None
        return excused(cmd, parse_script_args(module, args, module=True))
    if head in INTERPRETERS and len(argv) > 1:
        script, args = argv[1], argv[2:]
        if not (ROOT / script).is_file():
            return f"{script}: no such file in the checkout"
        if script in JOB_SCRIPTS:
            return check_job(cmd, args)
        return excused(cmd, parse_script_args(script, args))
    if head == "rayllm-rl":
        from rayllm_rl.cli import COMMANDS, main

        sub = argv[1] if len(argv) > 1 else "--help"
        if sub in ("train", "dry-run"):
            return check_job(cmd, argv[2:])
        if sub in ("--help", "-h", "recipes", "version", "--version"):
            with contextlib.redirect_stdout(io.StringIO()):
                return None if main([sub]) == 0 else f"`rayllm-rl {sub}` failed"
        return None if sub in COMMANDS else f"rayllm-rl has no command {sub!r} (it has {sorted(COMMANDS)})"
    if head in ("ray", ".venv/bin/ray") and argv[1:3] == ["job", "submit"] and "--" in argv:
        return check(dataclasses.replace(cmd, argv=argv[argv.index("--") + 1:]))
    if head == "make":
        makefile = (ROOT / "Makefile").read_text()
        missing = [t for t in argv[1:] if "=" not in t and not t.startswith("-")
                   and not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
        return f"the Makefile has no target {missing}" if missing else None
    if head in ("pip", "pip3") or argv[:3] in ([".venv/bin/python", "-m", "pip"], ["python", "-m", "pip"]):
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        named = {e.strip() for a in argv for m in re.finditer(r"(?:^|\.|rayllm_rl|rayllm-rl)\[([^\]]+)\]", a)
                 for e in m.group(1).split(",")}
        return f"pyproject.toml declares no extra {sorted(named - extras)}" if named - extras else None
    return excused(cmd, f"{head}: not something this test can check here; mark it `# needs: <what it needs>`")


WRONG = re.compile("|".join([
    r"^its parser refused",  # argparse: unrecognized arguments, invalid choice, error: argument ..., required ...
    r"unrecognized arguments|invalid choice|error: argument|the following arguments are required",
    r"\bunknown flag",  # the job's command line (cli.job_main)
    r"\bConfigError\b(?!: config file '[^']*' does not exist$)",  # config.py: unknown key, bad value, no such recipe
    r"\bunknown config key\b|\bhas no key\b|\bis not one of\b|\bis not read by\b|\bmoved to\b",
    r"\bKeyError\b",
    r"No module named 'rayllm_rl\b",  # a misspelt module of ours is a wrong value, not the user's file
]))
"""A problem that says a flag, a key or a value is wrong: never excused, whatever the line says it needs."""

LACKS = re.compile("|".join([
    r"not something this test can check here",  # sbatch, kubectl, docker, `ray start`: run elsewhere
    r"^ConfigError: config file '[^']*' does not exist$",  # config=YOUR.yaml
    r"no such file or folder|No such file or directory|\bFileNotFoundError\b",  # data.path=..., a script's input
    r"is neither an existing local directory nor a hub id|is neither a local directory nor a hub id",  # a model dir
    r"is not in the HF cache|\bLocalEntryNotFoundError\b",  # a hub model, offline here
    r"^ValueError: cannot import .*?: No module named '",  # reward.fn=YOUR.module:fn not on this PYTHONPATH
]))
"""A problem that says this machine lacks something the line needs: what `# needs: <what>` is for."""

SHIPPED = ("recipes", "examples", "launch", "jobs", "benchmarks", "rayllm_rl", "docs")
"""Folders of the checkout: a missing file named under one is a wrong path in the docs, not a file the user brings."""


def excused(cmd: Command, problem: str | None) -> str | None:
    """`problem`, unless the line says what it needs (`# needs: ...`) and the problem is only that this machine
    lacks it (`LACKS`: a cluster or tool this test cannot run, the user's files, modules or models, the model hub).
    A wrong flag, key or value (`WRONG`: argparse's refusals, the job's unknown flags, a `ConfigError`, a
    `KeyError`, a `ValueError` of the config's checks) is never excused, nor a missing file of the checkout's own
    folders (`SHIPPED`)."""
    if problem is None or not cmd.needs:
        return problem
    if WRONG.search(problem):
        return problem
    shipped = [p for p in re.findall(r"'([^']+)'", problem) if p.split("/")[0] in SHIPPED and "/" in p]
    if shipped:
        return f"{problem} ({shipped[0]} is in the checkout: `# needs:` does not excuse a wrong path of ours)"
    return None if LACKS.search(problem) else problem


def check_job(cmd: Command, args: list[str]) -> str | None:
    plan, problem = plan_job(args)
    if problem:
        return excused(cmd, problem)
    planning_only = "--dry-run" in args or cmd.argv[:2] == ["rayllm-rl", "dry-run"]  # plans GPUs, needs none
    if plan["total_gpus"] > 0 and not planning_only and not re.search(r"\bGPU", cmd.needs or ""):
        return f"plans {plan['total_gpus']:g} GPU(s): mark it `# needs: GPU` (or more, e.g. `# needs: 8 GPUs`)"
    return None


@pytest.fixture
def planned_offline(tmp_path, monkeypatch):
    """Run from the checkout (its recipes/ and examples/), the recipes' hub models' configs in an offline HF
    cache, the tiny model's cache and the storage root the test's own."""
    from test_recipes import HUB_CONFIGS, HUB_DATASETS, lay_out_datasets_cache, lay_out_hub_cache

    for repo_id, config in HUB_CONFIGS.items():
        lay_out_hub_cache(tmp_path / "hf" / "hub", repo_id, config)
    for name, configs in HUB_DATASETS.items():
        lay_out_datasets_cache(tmp_path / "hf" / "datasets", name, configs)
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "RAYLLM_STORAGE_ROOT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)


def test_the_checker_fails_a_broken_command(planned_offline):
    """What a doc could get wrong, each caught (so a broken command in the docs fails the test below)."""
    broken = """```bash
python jobs/grpo.py rollout.group_sise=8
python jobs/grpo.py config=recipes/no_such_recipe.yaml
python jobs/grpo.py ray.gpus_per_replica=1 ray.gpus_per_learner=1 inference.engine=vllm   # the fast path
.venv/bin/python benchmarks/engine_throughput.py --no-such-flag
make tset
pip install '.[trackers,wandb]'
rayllm-rl trian
sbatch launch/slurm/grpo.sbatch
python benchmarks/not_there.py
python jobs/grpo.py trainer.steps=2 \\  # a note here ends the command in a shell
    rollout.group_size=4
python jobs/grpo.py data.path=... rollout.max_stalenes=2   # needs: your rows
```
"""
    problems = {c.text.split("#")[0].strip(): check(c) for c in doc_commands(broken, "broken.md")}
    assert all(problems.values()), {k: v for k, v in problems.items() if not v}
    said = "\n".join(problems.values())
    for expected in ("group_sise", "no_such_recipe", "mark it `# needs: GPU`", "--no-such-flag", "no target ['tset']",
                     "no extra ['wandb']", "no command 'trian'", "sbatch: not something", "not_there.py: no such file",
                     "a comment after the line-continuing backslash ends the command", "max_stalenes"):
        assert expected in said, (expected, said)


def test_the_checker_accepts_what_is_right_and_reads_markers(planned_offline):
    good = """```bash
python jobs/grpo.py rollout.group_size=4 \\
    trainer.steps=2   # two steps
python jobs/grpo.py ray.gpus_per_replica=1 ray.gpus_per_learner=1   # needs: 2 GPUs
cd /tmp && make test
pip install '.[trackers,lora]'
RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \\
    -- python jobs/grpo.py rollout.max_staleness=2
sbatch --nodes=4 launch/slurm/grpo.sbatch   # needs: a Slurm cluster
.venv/bin/python launch/kuberay/schema/trim_crd.py ray.io_rayjobs.yaml out.json   # needs: KubeRay's CRD files
rayllm-rl recipes
```
"""
    commands = doc_commands(good, "good.md")
    assert [c.argv[0] for c in commands] == ["python", "python", "cd", "make", "pip", "RAY_AUTH_MODE=token", "sbatch",
                                             ".venv/bin/python", "rayllm-rl"]
    assert commands[0].argv[-1] == "trainer.steps=2" and commands[0].comment == "two steps"
    assert commands[1].needs == "2 GPUs" and commands[0].where == "good.md:2"
    assert {c.text: check(c) for c in commands} == {c.text: None for c in commands}


def test_every_command_in_the_readme_and_the_docs_matches_the_code(planned_offline):
    commands = [c for doc in DOCS for c in doc_commands(doc.read_text(), doc.relative_to(ROOT).as_posix())]
    assert len(commands) > 80, len(commands)  # the bash blocks were found
    problems = {f"{c.where}: {c.text}": p for c in commands if (p := check(c))}
    assert not problems, json.dumps(problems, indent=1)


def test_needs_never_excuses_a_wrong_flag_key_or_value(planned_offline, tmp_path):
    """`# needs: <what>` excuses only what this machine lacks, never a wrong flag, key or value (docs/packaging.md).
    Each line below is broken and says it needs something; the problem is the real output of running it (argparse's
    refusals, the job's command line, config.py's ConfigError, the config checks' ValueError, a script's own
    ConfigError or KeyError), and check() must still report it."""
    script = tmp_path / "reads_a_config.py"  # a script that reads its arguments without argparse
    script.write_text("import sys\nfrom rayllm_rl.config import load_config\nfrom rayllm_rl.job.config import "
                      "GRPOJobConfig\nload_config(GRPOJobConfig, sys.argv[1:])\n")
    keyed = tmp_path / "looks_up_a_key.py"
    keyed.write_text("import sys\nprint({'fast': 1, 'slow': 2}[sys.argv[1]])\n")
    broken = f"""```bash
.venv/bin/python benchmarks/engine_throughput.py --no-such-flag   # needs: an idle machine
.venv/bin/python benchmarks/engine_throughput.py --mode bogus   # needs: an idle machine
.venv/bin/python benchmarks/engine_throughput.py --mode   # needs: an idle machine
python benchmarks/distill_vs_rl.py --share 0.5   # needs: two runs' metrics.jsonl
python -m rayllm_rl.export_lora --dtype float16 adapter out   # needs: your adapter
python jobs/grpo.py --dry-runn config=my.yaml   # needs: your my.yaml
python jobs/grpo.py data.path=rows.jsonl rollout.max_stalenes=2   # needs: your rows
python jobs/grpo.py data.path=rows.jsonl ~rollout.max_stalenes   # needs: your rows
python jobs/grpo.py data.path=rows.jsonl algo.name=gpro   # needs: your rows
python jobs/grpo.py data.path=rows.jsonl rollout.group_size=0   # needs: your rows
python jobs/grpo.py data.path=rows.jsonl rollout.top_p=2   # needs: your rows
python jobs/grpo.py data.path=rows.jsonl task=gsm8kk   # needs: your rows
python jobs/grpo.py model.path=/models/mine ray.gpus_per_learner=0.5   # needs: your model
python jobs/grpo.py config=recipe:smollm2   # needs: the recipe's model
python jobs/grpo.py config=recipes/no_such_recipe.yaml   # needs: 8 GPUs
python jobs/grpo.py reward.fn=rayllm_rl.rewards.no_such:score   # needs: your rows
python {script} rollout.max_stalenes=2   # needs: your cluster
python {keyed} fastest   # needs: your cluster
```
"""
    problems = {c.text.split("#")[0].strip(): check(c) for c in doc_commands(broken, "broken.md")}
    assert all(c.needs for c in doc_commands(broken, "broken.md"))
    excused_wrongly = [k for k, v in problems.items() if not v]
    assert not excused_wrongly, "`# needs:` excused a wrong flag, key or value: " + " | ".join(excused_wrongly)
    said = "\n".join(problems.values())
    for expected in ("error: unrecognized arguments: --no-such-flag", "invalid choice: 'bogus'",
                     "argument --mode: expected one argument", "the following arguments are required: --rl",
                     "invalid choice: 'float16'", "unknown flag(s) ['--dry-runn']",
                     "unknown config key 'rollout.max_stalenes'", "rollout has no key 'max_stalenes'",
                     "'gpro' is not one of", "rollout.group_size=0: must be > 0", "rollout.top_p must be in (0, 1]",
                     "task='gsm8kk' is neither a built-in task", "must be a whole number of GPUs",
                     "config=recipe:smollm2: no such recipe", "recipes/no_such_recipe.yaml is in the checkout",
                     "No module named 'rayllm_rl.rewards.no_such'",
                     "raised ConfigError: unknown config key 'rollout.max_stalenes'", "raised KeyError: 'fastest'"):
        assert expected in said, (expected, said)


def test_needs_excuses_what_this_machine_lacks(planned_offline, tmp_path):
    """What `# needs:` is for, each excused with the marker and reported without it: a command this test cannot
    run, the user's config file, rows, model, reward module and input files, a hub model (offline here)."""
    script = tmp_path / "reads_a_file.py"
    script.write_text("import sys\nopen(sys.argv[1]).read()\n")
    lacking = f"""```bash
sbatch launch/slurm/grpo.sbatch   # needs: a Slurm cluster
python jobs/grpo.py config=my.yaml rollout.group_size=4   # needs: your my.yaml
python jobs/grpo.py task=math data.path=/data/math500.parquet   # needs: your rows
python jobs/grpo.py model.path=/models/my-sft-checkpoint   # needs: your model
PYTHONPATH=. python jobs/grpo.py reward.fn=myreward:score data.path=rows.jsonl   # needs: your myreward.py
python jobs/grpo.py model.path=org/name-GGUF model.gguf_file=model.Q4_K_M.gguf   # needs: the model hub
python {script} crd.yaml   # needs: KubeRay's CRD files
```
"""
    commands = doc_commands(lacking, "lacking.md")
    assert len(commands) == 7 and all(c.needs for c in commands)
    assert {c.text: check(c) for c in commands} == {c.text: None for c in commands}
    unmarked = [dataclasses.replace(c, comment="") for c in commands]
    assert all(check(c) for c in unmarked), {c.text: check(c) for c in unmarked}
