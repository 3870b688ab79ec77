"""Failed samples inside an episode: the `failed` key, the causes it names, and the placeholder row of a sample
that produced no tokens.

An environment, a tool, a sandbox, a reward or the inference server may raise, hang past its timeout or go
away. None of these is a reward of 0: the sample (one trajectory, one row of the episode's `[n, T]` batch) is
*failed*, and `rollout.on_failure` (rollout/failures.py) decides what its group does. A workflow says so in the
TensorDict it returns (AReaL's contract is unchanged): the per-sequence key `failed` `[n]` holds 0 for a finished
row and, for a failed one, the code of its cause (`CAUSES`: 1 = raised, 2 = timeout, ...). The reward path sets it
without the workflow knowing: a `RewardCaller` whose function raises, hangs or returns NaN returns its scores with
`failed` set, and workflows pass scores on as per-sequence keys. A sample that failed before it generated a token
is a *placeholder* row (`failed_row`: the prompt alone, nothing trained on) so the episode still says how many of
its samples failed and why; `guard_sample` makes one from a sample's exception or timeout.

The collector also reads two keys it may add to a row (`SAMPLES_KEY`, `ATTEMPT_KEY`) when it runs a prompt's
missing samples again: the built-in workflows then generate only that many; a workflow that ignores them
generates a whole group and the collector keeps what it needs.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Awaitable, Mapping, Sequence

import torch
from tensordict import TensorDict

log = logging.getLogger(__name__)

FAILED_KEY = "failed"
"""Per-sequence key `[n]`: 0 = finished, else the code of the failure's cause (`code_of`)."""

CAUSES = ("raised", "timeout", "server_lost", "reward_raised", "reward_timeout", "reward_nonfinite")
"""Why a sample failed, by code - 1: its workflow / environment / tool raised; it ran past its timeout; the
inference server (or an actor it ran on) went away; its reward raised (or returned something that is not a
reward); its reward ran past its timeout; its reward was NaN or infinite."""

SAMPLES_KEY = "num_samples"
"""Row key the collector sets when it runs a prompt again: how many samples it still needs."""
ATTEMPT_KEY = "attempt"
"""Row key the collector sets when it runs a prompt again: 1 for the first re-run, 2 for the next, ..."""

COLLECTOR_KEYS = frozenset({SAMPLES_KEY, ATTEMPT_KEY})
"""Row keys the collector adds, which no reward function gets as a column."""

SERVER_LOST_NAMES = frozenset({"RayActorError", "ActorDiedError", "ActorUnavailableError", "EngineDeadError"})
"""Exception classes (by name: this layer imports neither Ray nor vLLM) that mean the server is gone."""


def code_of(cause: str) -> int:
    """The `failed` code of `cause` (ValueError naming the known causes for another)."""
    if cause not in CAUSES:
        raise ValueError(f"unknown failure cause {cause!r}; known: {list(CAUSES)}")
    return CAUSES.index(cause) + 1


def cause_of_code(code: float) -> str:
    """The cause a `failed` code names; a code outside `CAUSES` (a workflow's own marker, e.g. 1.0) is 'raised'."""
    i = int(code) - 1
    return CAUSES[i] if 0 <= i < len(CAUSES) else "raised"


def cause_of(exc: BaseException) -> str:
    """'timeout', 'server_lost' or 'raised' for an exception a sample or episode ended with (its `__cause__`
    chain read too: an actor's death re-raised as a RuntimeError is still a lost server)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, (TimeoutError, asyncio.TimeoutError)):
            return "timeout"
        names = {t.__name__ for t in type(seen).__mro__}
        if isinstance(seen, ConnectionError) or names & SERVER_LOST_NAMES:
            return "server_lost"
        seen = seen.__cause__
    return "raised"


def failed_row(group_id: int, cause: str, prompt_ids: Sequence[int] | None = None) -> TensorDict:
    """The placeholder `[1, P]` row of a sample that failed before it generated anything: the prompt's tokens (one
    pad token without them), nothing trained on (loss_mask 0, versions -1), reward 0, `failed` = the cause's code."""
    ids = list(prompt_ids or [0])
    n = len(ids)
    return TensorDict({
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "attention_mask": torch.ones((1, n), dtype=torch.bool),
        "loss_mask": torch.zeros((1, n), dtype=torch.bool),
        "logprobs": torch.zeros((1, n), dtype=torch.float32),
        "versions": torch.full((1, n), -1, dtype=torch.long),
        "rewards": torch.zeros(1, dtype=torch.float32),
        "group_id": torch.tensor([int(group_id)], dtype=torch.long),
        FAILED_KEY: torch.tensor([float(code_of(cause))], dtype=torch.float32),
    }, batch_size=[1])


async def guard_sample(sample: Awaitable[TensorDict], group_id: int, prompt_ids: Sequence[int] | None = None,
                       timeout_s: float | None = None) -> TensorDict:
    """One sample's trajectory, or its placeholder `failed_row` if it raised (cause by `cause_of`) or ran past
    `timeout_s` (None: no bound of its own; the episode's bounds it): a group's other samples go on."""
    try:
        return await asyncio.wait_for(sample, timeout_s)
    except Exception as exc:  # noqa: BLE001 - one sample's failure is counted, never the group's
        cause = cause_of(exc)
        log.warning("a sample of group %s failed (%s): %s: %s", group_id, cause, type(exc).__name__, exc)
        return failed_row(group_id, cause, prompt_ids)


def failed_mask(td: TensorDict) -> torch.Tensor:
    """`[n]` bool: the rows whose `failed` key is set (all False without the key)."""
    if FAILED_KEY not in td.keys():
        return torch.zeros(td.batch_size[0], dtype=torch.bool)
    return td[FAILED_KEY].reshape(-1) != 0


def count_causes(td: TensorDict) -> collections.Counter:
    """Failed rows by cause."""
    if FAILED_KEY not in td.keys():
        return collections.Counter()
    codes = td[FAILED_KEY].reshape(-1)
    return collections.Counter(cause_of_code(float(c)) for c in codes[codes != 0].tolist())


def without_failed_key(td: TensorDict) -> TensorDict:
    """`td` without its `failed` key (what the buffer stores: the key is the collector's, not a metric)."""
    return td.exclude(FAILED_KEY) if FAILED_KEY in td.keys() else td


def score_failure(scores: Mapping[str, Any]) -> float:
    """The `failed` code a reward's scores carry (0.0: none)."""
    return float(scores.get(FAILED_KEY, 0.0) or 0.0)
