"""The run's `traces.jsonl`: a few trained rows per step, decoded, written by the driver and read by the viewer.

One line per RL step: `{"step", "samples": [...]}`. A sample holds the prompt's text, then per token
after the prompt its text, whether it was trained, the policy version that sampled it, its version
lag (the version trained from minus that), and the learner's minus the rollout's logprob (the
mismatch; None where not trained), with the reward and its components. The file stops growing at
`TRACE_MAX_BYTES` (a line in it says so), so a long run's directory stays small.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

TRACE_FILE = "traces.jsonl"
TRACE_MAX_BYTES = 32 << 20
"""Past this size a run writes no more traces (32 MiB: e.g. 500 steps of 4 rows of 1k tokens)."""


def decode_sample(row: dict, tokenizer) -> dict[str, Any]:
    """One of the learner's trace rows (learner/trace_rows.py) with its text, per-token lag and mismatch."""
    start = row.get("trained_from")
    lag = [None if v < 0 or start is None else start - v for v in row["versions"]]
    diff = [None if lp is None else round(lp - rp, 5) for lp, rp in zip(row["learner_logp"], row["rollout_logp"])]
    return {"prompt": tokenizer.decode(row["prompt_ids"]), "tokens": tokenizer.batch_decode([[t] for t in row["ids"]]),
            "trained": row["trained"], "versions": row["versions"], "lag": lag, "mismatch": diff,
            "reward": row["reward"], "components": row["components"], "trained_from": start,
            "cut_tokens": row["cut_tokens"]}


class TraceWriter:
    """Appends each step's decoded trace rows to `<run dir>/traces.jsonl`, up to `max_bytes`."""

    def __init__(self, run_dir: str | Path, tokenizer, max_bytes: int = TRACE_MAX_BYTES):
        self.path = Path(run_dir) / TRACE_FILE
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.full = self.path.exists() and self.path.stat().st_size >= max_bytes

    def write(self, step: int, rows: Iterable[dict]) -> None:
        rows = list(rows)
        if self.full or not rows:
            return
        line = json.dumps({"step": int(step), "samples": [decode_sample(r, self.tokenizer) for r in rows]})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            if f.tell() >= self.max_bytes:
                self.full = True
                f.write(json.dumps({"step": int(step), "stopped": f"{TRACE_FILE} reached {self.max_bytes} bytes: "
                                                                  "no traces after this step"}) + "\n")


def read_traces(run_dir: str | Path) -> list[dict]:
    """Every line of the run's traces.jsonl (a missing file is an error naming it; a torn last line is skipped)."""
    path = Path(run_dir) / TRACE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: the run wrote no traces (a run of this version writes them "
                                "from its first RL step)")
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
    return out
