"""`python jobs/grpo.py [config=recipe:NAME | config=file.yaml] [key.sub=value ...] [--dry-run [--json]]`: the
GRPO-family job from a checkout, what `ray job submit --working-dir . -- python jobs/grpo.py ...` runs. The same as
`rayllm-rl train ...` (`rayllm-rl dry-run ...` for --dry-run) once the package is installed; `--help` lists
every key (rayllm_rl/cli.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rayllm_rl.cli import job_command, job_main

main = job_main  # in-process callers get the exception

if __name__ == "__main__":
    job_command(sys.argv[1:])  # a config error: one message naming the key, exit status 1
