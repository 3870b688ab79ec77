"""The trajectory TensorDict: token-in/token-out, right-padded, batch dim first.

Per-token keys `[N, T]`: input_ids, attention_mask, loss_mask (1 on policy-generated tokens),
logprobs (behaviour logprobs, 0 elsewhere), versions (policy version per generated token, -1
elsewhere). Per-sequence keys `[N]`: rewards, group_id. A packed view (`cu_seqlens`) is
available for varlen kernels and buffers. `TrajectoryBuilder` assembles one sequence from engine
responses turn by turn (append-only, so multi-turn episodes never re-tokenize the past).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
SEQ_KEYS = ("rewards", "group_id")
PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "loss_mask": 0, "logprobs": 0.0, "versions": -1}
DTYPES = {
    "input_ids": torch.long, "attention_mask": torch.bool, "loss_mask": torch.bool,
    "logprobs": torch.float32, "versions": torch.long, "rewards": torch.float32, "group_id": torch.long,
}


def make_trajectory(
    input_ids: Sequence[int],
    logprobs: Sequence[float],
    loss_mask: Sequence[int],
    versions: Sequence[int],
    reward: float,
    group_id: int = 0,
    **extra: float,
) -> TensorDict:
    """One sequence as a batch-of-1 trajectory; token lists must have equal lengths."""
    n = len(input_ids)
    for name, seq in (("logprobs", logprobs), ("loss_mask", loss_mask), ("versions", versions)):
        if len(seq) != n:
            raise ValueError(f"make_trajectory: {name} has {len(seq)} entries, input_ids has {n}")
    data = {
        "input_ids": torch.tensor([list(input_ids)], dtype=torch.long),
        "attention_mask": torch.ones((1, n), dtype=torch.bool),
        "loss_mask": torch.tensor([list(loss_mask)], dtype=torch.bool),
        "logprobs": torch.tensor([list(logprobs)], dtype=torch.float32),
        "versions": torch.tensor([list(versions)], dtype=torch.long),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
        "group_id": torch.tensor([int(group_id)], dtype=torch.long),
    }
    for k, v in extra.items():
        data[k] = torch.tensor([float(v)], dtype=torch.float32)
    return TensorDict(data, batch_size=[1])


class TrajectoryBuilder:
    """One sequence built turn by turn from engine responses, for `make_trajectory`.

    Tokens are only ever appended, so a multi-turn episode trains on exactly the ids the engine
    saw and produced: `add_prompt` accepts a turn's full prompt only if it extends what is already
    there (the past was not re-tokenized). Context tokens (prompts, feedback, tool results) get
    loss_mask 0, logprob 0.0, version -1; generated ones loss_mask 1 and the engine's logprobs
    and versions. `build` gives a batch-of-1 TensorDict: token keys `[1, T]`, `rewards` and
    `group_id` (and each extra) `[1]`.
    """

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.versions: list[int] = []

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append `[k]` tokens the policy did not generate (feedback, tool results): masked out."""
        n = len(ids)
        self.input_ids += list(ids)
        self.logprobs += [0.0] * n
        self.loss_mask += [0] * n
        self.versions += [-1] * n

    def add_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Take the full prompt `[P]` of the next engine call: it must start with the tokens so far
        (else ValueError, the past was re-tokenized); its new tail is appended as context."""
        n = len(self.input_ids)
        if list(prompt_ids[:n]) != self.input_ids:
            raise ValueError("prompt does not extend the trajectory (re-tokenized past)")
        self.add_context(prompt_ids[n:])

    def add_generated(self, response) -> None:
        """Append what the engine generated: `response.output_tokens/output_logprobs/output_versions`
        (an `LLMResponse` or alike), each `[k]`, trained on (loss_mask 1)."""
        ids, lps, vers = response.output_tokens, response.output_logprobs, response.output_versions
        if not len(ids) == len(lps) == len(vers):
            raise ValueError(f"generated tokens/logprobs/versions lengths differ: {len(ids)}/{len(lps)}/{len(vers)}")
        self.input_ids += list(ids)
        self.logprobs += list(lps)
        self.loss_mask += [1] * len(ids)
        self.versions += list(vers)

    def build(self, reward: float, group_id: int = 0, **extra: float) -> TensorDict:
        """The sequence so far as a batch-of-1 trajectory (see `make_trajectory`)."""
        return make_trajectory(self.input_ids, self.logprobs, self.loss_mask, self.versions, reward, group_id, **extra)


def validate_trajectory(td: TensorDict) -> None:
    """Raise a ValueError naming the first missing key or mis-shaped tensor."""
    missing = [k for k in TOKEN_KEYS + SEQ_KEYS if k not in td.keys()]
    if missing:
        raise ValueError(f"trajectory is missing keys {missing}; has {sorted(td.keys())}")
    if td.batch_dims != 1:
        raise ValueError(f"trajectory must have one batch dim, got batch_size {tuple(td.batch_size)}")
    shape = td["input_ids"].shape
    for k in TOKEN_KEYS:
        if td[k].shape != shape:
            raise ValueError(f"trajectory key {k!r} has shape {tuple(td[k].shape)}, input_ids has {tuple(shape)}")
    for k in SEQ_KEYS:
        if td[k].shape != shape[:1]:
            raise ValueError(f"trajectory key {k!r} must have shape {tuple(shape[:1])} (one per sequence), "
                             f"got {tuple(td[k].shape)}")
    if bool((td["loss_mask"] & ~td["attention_mask"]).any()):
        raise ValueError("trajectory loss_mask is 1 on a padding position")


EPISODE_CONTRACT = (f"an episode is a TensorDict with batch dim first holding {list(TOKEN_KEYS)} [n, T] and "
                    f"{list(SEQ_KEYS)} [n] (TrajectoryBuilder makes them; docs/extending.md)")


def check_episode(out: Any, group_id: int | None = None, source: str = "the workflow") -> TensorDict | None:
    """What a workflow's `arun_episode` returned, as the trajectory batch the buffer stores, or None (AReaL's "reject
    this episode"). A dict of tensors becomes a TensorDict and the required keys take their dtypes (`DTYPES`).
    ValueError naming `source` and what is wrong: not a TensorDict, missing keys or bad shapes
    (`validate_trajectory`), a trained token (loss_mask 1) with no policy version or a non-finite logprob, a
    non-finite reward, or a `group_id` other than the row's (every trajectory of an episode carries it)."""
    if out is None:
        return None
    where = f"{source}.arun_episode returned"
    if isinstance(out, Mapping) and not isinstance(out, TensorDictBase):
        try:
            out = TensorDict({k: torch.as_tensor(v) for k, v in out.items()}, batch_size=[len(out["input_ids"])])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{where} a dict that is not a batch of trajectories ({type(exc).__name__}: {exc}); "
                             f"{EPISODE_CONTRACT}") from None
    if not isinstance(out, TensorDictBase):
        raise ValueError(f"{where} a {type(out).__name__}, not a TensorDict (or None to reject it); {EPISODE_CONTRACT}")
    missing = [k for k in TOKEN_KEYS + SEQ_KEYS if k not in out.keys()]
    if missing:
        raise ValueError(f"{where} an episode missing the keys {missing} (it has {sorted(out.keys())}); "
                         f"{EPISODE_CONTRACT}")
    for key, dtype in DTYPES.items():
        if out[key].dtype != dtype:
            out[key] = out[key].to(dtype)
    try:
        validate_trajectory(out)
    except ValueError as exc:
        raise ValueError(f"{where} an invalid episode: {exc}; {EPISODE_CONTRACT}") from None
    trained = out["loss_mask"]
    unversioned = int((out["versions"][trained] < 0).sum())
    if unversioned:
        raise ValueError(f"{where} {unversioned} trained tokens (loss_mask 1) with no policy version (versions < 0): "
                         "each generated token carries the version of the policy that sampled it "
                         "(LLMResponse.output_versions, which TrajectoryBuilder.add_generated copies)")
    if not bool(torch.isfinite(out["logprobs"][trained]).all()):
        raise ValueError(f"{where} non-finite logprobs on trained tokens: they must be the engine's behaviour logprobs")
    if not bool(torch.isfinite(out["rewards"]).all()):
        raise ValueError(f"{where} non-finite rewards {out['rewards'].tolist()[:8]}")
    if group_id is not None and not bool((out["group_id"] == int(group_id)).all()):
        raise ValueError(f"{where} trajectories with group_id {sorted(set(out['group_id'].tolist()))[:4]} for a row of "
                         f"group {int(group_id)}: every trajectory of an episode carries the row's data['group_id'] "
                         "(the collector's id of the episode, and GRPO's group)")
    return out


def concat_padded(tds: Iterable[TensorDict]) -> TensorDict:
    """Concatenate trajectories along the batch dim, right-padding token keys to the longest.

    Per-sequence extras (reward components) missing from some parts are filled with 0.0.
    """
    tds = list(tds)
    if not tds:
        raise ValueError("concat_padded: empty list")
    width = max(td["input_ids"].shape[-1] for td in tds)
    keys = list(tds[0].keys())
    for td in tds[1:]:
        keys += [k for k in td.keys() if k not in keys]
    out = {}
    for k in keys:
        parts = []
        for td in tds:
            if k not in td.keys():
                if k in TOKEN_KEYS + SEQ_KEYS:
                    raise ValueError(f"concat_padded: a trajectory lacks the required key {k!r}")
                # a per-sequence extra (reward component) one workflow did not report: 0.0
                v = torch.zeros(td.batch_size[0], dtype=torch.float32)
                parts.append(v)
                continue
            v = td[k]
            if k in PAD_VALUES or (v.dim() == 2 and v.shape[-1] == td["input_ids"].shape[-1]):
                pad = width - v.shape[-1]
                if pad:
                    v = torch.nn.functional.pad(v, (0, pad), value=PAD_VALUES.get(k, 0))
            parts.append(v)
        out[k] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[sum(td.batch_size[0] for td in tds)])


def seq_lengths(td: TensorDict) -> torch.Tensor:
    """Valid length of each sequence `[N]` (right padding)."""
    return td["attention_mask"].sum(-1)


def pack_sequences(td: TensorDict) -> tuple[TensorDict, torch.Tensor]:
    """Drop padding: token keys become `[total]`, with `cu_seqlens` `[N+1]` marking boundaries."""
    lengths = seq_lengths(td)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    keep = td["attention_mask"].bool()
    packed = {k: td[k][keep] for k in td.keys() if td[k].dim() == 2 and td[k].shape == keep.shape}
    return TensorDict(packed, batch_size=[int(cu[-1])]), cu
