"""A few trained rows of a step, token by token, for the trace viewer (`python -m rayllm_rl.view`).

The learner keeps them from the forward it runs anyway (the step's first minibatch, before the
update, as the mismatch figures): token ids, the policy version that sampled each token, the rollout's
and the learner's logprob, the reward and its components. Bounded: `TRACE_ROWS` rows a step, at most
`TRACE_TOKENS` tokens after the prompt each. The driver decodes them and appends them to the run's
`traces.jsonl` (`rayllm_rl/view/records.py`).
"""
from __future__ import annotations

import torch

TRACE_ROWS = 4
"""Rows kept per train step (spread over the first micro-batch of learner rank 0)."""
TRACE_TOKENS = 512
"""Tokens kept after the prompt of each row."""
_NOT_COMPONENTS = frozenset({"rewards", "advantages", "group_id", "truncated", "prox_version"})


def _rounded(t: torch.Tensor, digits: int = 5) -> list:
    return [round(float(x), digits) for x in t.tolist()]


def trace_rows(mb, logp: torch.Tensor, limit: int = TRACE_ROWS, max_tokens: int = TRACE_TOKENS) -> list[dict]:
    """Up to `limit` rows of micro-batch `mb` (`input_ids`, `attention_mask`, `loss_mask`, `versions`,
    `logprobs` `[n, T]`; `rewards`, `prox_version` and reward components `[n]`) with the learner's
    logprobs `logp` `[n, T]` of them. Each row: `prompt_ids`, then per token after the prompt `ids`,
    `trained` (loss mask), `versions`, `rollout_logp` and `learner_logp` (None where not trained)."""
    n = int(mb["input_ids"].shape[0])
    if n == 0 or limit <= 0 or "versions" not in mb.keys():  # no versions: nothing says an engine sampled it
        return []
    picks = sorted({i * n // min(n, limit) for i in range(min(n, limit))})
    components = [k for k in mb.keys() if k not in _NOT_COMPONENTS and mb[k].dim() == 1 and mb[k].is_floating_point()]
    rows = []
    for i in picks:
        keep = mb["attention_mask"][i].bool().cpu()
        ids = mb["input_ids"][i].cpu()[keep]
        trained = mb["loss_mask"][i].cpu()[keep].bool()
        start = int(trained.nonzero()[0]) if trained.any() else len(ids)
        end = min(len(ids), start + max_tokens)
        part = slice(start, end)
        learner = logp[i].detach().float().cpu()[keep][part]
        row = {"prompt_ids": ids[:start].tolist(), "ids": ids[part].tolist(), "trained": trained[part].tolist(),
               "versions": mb["versions"][i].cpu()[keep][part].tolist(),
               "rollout_logp": _rounded(mb["logprobs"][i].float().cpu()[keep][part]),
               "learner_logp": [round(float(v), 5) if t else None for v, t in zip(learner, trained[part])],
               "cut_tokens": len(ids) - end, "reward": float(mb["rewards"][i]) if "rewards" in mb.keys() else None,
               "components": {k: float(mb[k][i]) for k in components}}
        if not any(v >= 0 for v in row["versions"]):  # no engine sampled it (an SFT demonstration)
            continue
        if "prox_version" in mb.keys():
            row["trained_from"] = int(mb["prox_version"][i])
        rows.append(row)
    return rows
