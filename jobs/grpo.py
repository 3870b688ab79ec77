"""GRPO-family training job. `python jobs/grpo.py [config=file.yaml] [key.sub=value ...]`.

With no arguments it runs the embedded default on a local Ray (CPU): the offline tiny
Qwen2, the built-in arithmetic task, an SFT warm start, then asynchronous GRPO
(rollout.max_staleness=1). Under `ray job submit --working-dir . -- python jobs/grpo.py`
it joins that cluster. `trainer.backend=local` runs everything in one process.
The last stdout line is a JSON summary.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rayllm_rl.config import describe, load_config  # noqa: E402
from rayllm_rl.orchestration.job_config import GRPOJobConfig  # noqa: E402


def main(argv: list[str]) -> dict:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(describe(GRPOJobConfig()))
        sys.exit(0)
    cfg = load_config(GRPOJobConfig, argv).validate()  # cross-field mistakes fail before any actor starts
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from rayllm_rl.orchestration.entry import train

    summary = train(cfg)
    sys.stdout.write(json.dumps(summary, default=str) + "\n")
    sys.stdout.flush()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
