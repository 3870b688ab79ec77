"""GRPO-family training job. `python jobs/grpo.py [config=file.yaml] [key.sub=value ...]`.

With no arguments it runs the embedded default: the offline tiny Qwen2, the built-in
arithmetic task, an SFT warm start, then GRPO on CPU. The last stdout line is a JSON summary.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rayllm_rl.config import describe, load_config  # noqa: E402
from rayllm_rl.orchestration.job_config import GRPOJobConfig  # noqa: E402
from rayllm_rl.orchestration.local_trainer import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(describe(GRPOJobConfig()))
        sys.exit(0)
    main(load_config(GRPOJobConfig, argv))
