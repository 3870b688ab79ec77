"""From a rollout batch to a training batch: the named stages of the batch pipeline, built once.

`make_batch_pipeline(cfg, frozen)` builds the stages the job's config asks for, in their order:
reward shaping (DAPO's overlong penalty), reference KL (and KL-in-reward), top-k selection, advantages,
the distillation teacher's KL (per-token advantages), and the proximal version stamp. The job plan holds the
pipeline; the replay buffer (the buffer's actor on Ray, the driver's process locally) gets it when it is made
and runs it where the batch is (`prepare_batch`), so the driver sees only `step_metadata`: scalars and short
lists, never tensors. Every stage has one signature, `stage(batch [N, ...], version) -> batch [N', ...]` (only
selection changes N), and declares the frozen models' outputs it reads (`needs`: model name -> the batch key
their logprobs `[N, T]` go to), which `prepare_batch` scores before the stages run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Awaitable, Callable, ClassVar, Collection, Mapping

import torch

SEQ_CORE = frozenset({"rewards", "group_id", "advantages", "prox_version"})


@dataclasses.dataclass(frozen=True)
class OverlongShaping:
    """DAPO's overlong penalty on `rewards` `[N]`, from each completion's length."""

    name = "overlong_shaping"
    max_new_tokens: int
    buffer_len: int
    penalty: float

    def __call__(self, batch, version: int):
        from rayllm_rl.objectives.dapo import overlong_reward_shaping

        lengths = batch["loss_mask"].sum(-1)
        batch["rewards"] = batch["rewards"] + overlong_reward_shaping(lengths, self.max_new_tokens, self.buffer_len,
                                                                      self.penalty)
        return batch


@dataclasses.dataclass(frozen=True)
class ReferenceKL:
    """The frozen reference's logprobs (`ref_logprobs` `[N, T]`, put on the batch by the pipeline) become the
    per-token `kl` `[N, T]` (TorchRL's RetrieveKL); with `reward_coef` > 0, `rewards -= coef * sum_t kl_t`."""

    name = "reference_kl"
    needs: ClassVar[Mapping[str, str]] = {"reference": "ref_logprobs"}
    reward_coef: float

    def __call__(self, batch, version: int):
        from rayllm_rl.objectives.kl_reward import KLRewardTransform, RetrieveKL

        if "ref_logprobs" not in batch.keys():
            raise ValueError("the batch pipeline has a reference_kl stage but the batch came without the reference's "
                             "logprobs (start the reference before taking batches)")
        RetrieveKL(lambda b: b["ref_logprobs"])(batch)
        if self.reward_coef > 0:
            KLRewardTransform(self.reward_coef)(batch)
        return batch


@dataclasses.dataclass(frozen=True)
class TopKSelection:
    """TorchRL's TopKRewardSelector: of each group, at most `k` rows whose reward is above the group's
    median (ties: the earlier row), so a uniform group keeps none and the batch may shrink to 0 rows."""

    name = "top_k_selection"
    k: int

    def __call__(self, batch, version: int):
        from rayllm_rl.data.selectors import TopKRewardSelector

        return TopKRewardSelector(self.k)(batch)


@dataclasses.dataclass(frozen=True)
class Advantages:
    """`advantages` `[N]` from the rewards and groups of the rows left (`algo.advantage`)."""

    name = "advantages"
    config: Any

    def __call__(self, batch, version: int):
        from rayllm_rl.objectives import compute_advantages

        batch["advantages"] = compute_advantages(batch["rewards"], batch["group_id"], self.config)
        return batch


@dataclasses.dataclass(frozen=True)
class TeacherKL:
    """On-policy distillation: the teacher's logprobs of the sampled tokens (`teacher_logprobs` `[N, T]`, put on
    the batch by the pipeline) become `teacher_kl` `[N, T]` and the per-token `advantages` `[N, T]` =
    `task_coef * A_task - coef * teacher_kl` (`objectives.distill`); after `advantages`, which made A_task `[N]`."""

    name = "teacher_kl"
    needs: ClassVar[Mapping[str, str]] = {"teacher": "teacher_logprobs"}
    coef: float
    task_coef: float

    def __call__(self, batch, version: int):
        from rayllm_rl.objectives.distill import distill_advantages, teacher_kl

        if "teacher_logprobs" not in batch.keys():
            raise ValueError("the batch pipeline has a teacher_kl stage but the batch came without the teacher's "
                             "logprobs (start the teacher before taking batches)")
        mask = batch["loss_mask"]
        kl = teacher_kl(batch["logprobs"].float(), batch["teacher_logprobs"], mask)
        batch["teacher_kl"] = kl  # kept for the step's figures; the teacher's own logprobs are not sent on
        del batch["teacher_logprobs"]
        task = batch["advantages"] if self.task_coef > 0 else None
        batch["advantages"] = distill_advantages(kl, mask, self.coef, task, self.task_coef)
        return batch


@dataclasses.dataclass(frozen=True)
class ProxVersion:
    """`prox_version` `[N]`: the policy version the learner trains this batch from
    (`algo.prox_logp_method=loglinear` interpolates the proximal logprobs with it)."""

    name = "prox_version"

    def __call__(self, batch, version: int):
        batch["prox_version"] = torch.full(batch["rewards"].shape, int(version), dtype=torch.long)
        return batch


@dataclasses.dataclass(frozen=True)
class BatchPipeline:
    """The stages, in order (`prepare_batch` scores the batch with the frozen models they need, then runs them)."""

    stages: tuple

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def needs(self) -> dict[str, str]:
        """Frozen model name -> the batch key its logprobs go to, for every stage that reads one."""
        out: dict[str, str] = {}
        for stage in self.stages:
            out.update(getattr(stage, "needs", {}))
        return out

    def __call__(self, batch, version: int, scored: Mapping[str, Any] | None = None):
        """Rollout batch `[N]` -> training batch `[N']` (use the returned batch: it may be smaller).
        `scored`: batch key -> the frozen models' logprobs `[N, T]` of this batch (`needs`)."""
        for key, logprobs in (scored or {}).items():
            batch[key] = torch.as_tensor(logprobs, dtype=torch.float32)
        for stage in self.stages:
            batch = stage(batch, version)
        return batch


Score = Callable[[str, Any], Awaitable[tuple[Any, int]]]
"""`score(name, batch)` -> (frozen model `name`'s logprobs `[N, T]` of `batch`, how many times a restart made it
score the batch again)."""


async def prepare_batch(pipeline: BatchPipeline, batch, version: int, score: Score) -> tuple[Any, dict]:
    """(training batch, its step metadata) of a rollout batch trained from `version`: every frozen model a stage
    needs scores the batch (`score`; `{name}_s` its seconds, `{name}_rescored` its restarts), then the stages run.
    Both backends call it: the local one in the driver's process, the Ray one in the replay buffer's actor."""
    scored, timed = {}, {}
    for name, key in pipeline.needs().items():
        t0 = time.perf_counter()
        scored[key], rescored = await score(name, batch)
        timed.update({f"{name}_s": time.perf_counter() - t0, f"{name}_rescored": rescored})
    batch = pipeline(batch, version, scored)
    return batch, {**step_metadata(batch, version), **timed}


def make_batch_pipeline(cfg, frozen: Collection[str] = ()) -> BatchPipeline:
    """The stages `cfg` asks for; `frozen`: the names of the job's frozen models (`JobPlan.frozen`), whose stages
    (reference KL, the teacher's KL) run."""
    a = cfg.algo
    stages: list = []
    if a.overlong_buffer_len > 0:
        stages.append(OverlongShaping(cfg.rollout.max_new_tokens, a.overlong_buffer_len, a.overlong_penalty))
    if "reference" in frozen:
        stages.append(ReferenceKL(a.kl_reward_coef))
    if cfg.rollout.keep_top_k > 0:
        stages.append(TopKSelection(cfg.rollout.keep_top_k))
    stages.append(Advantages(a.advantage))
    if "teacher" in frozen:
        stages.append(TeacherKL(cfg.teacher.coef, cfg.teacher.task_coef))
    stages.append(ProxVersion())
    return BatchPipeline(tuple(stages))


def reward_component_means(batch) -> dict[str, float]:
    """Batch means of the per-sequence extras (reward components, success, truncated, num_turns)."""
    return {k: float(batch[k].float().mean()) for k in batch.keys()
            if k not in SEQ_CORE and batch[k].dim() == 1}


def step_metadata(batch, version: int) -> dict:
    """What the driver logs of a training batch trained from `version`: plain numbers and lists."""
    from rayllm_rl.rollout.replay_buffer import batch_staleness_stats

    lag = batch_staleness_stats(batch, version)
    return {"reward": float(batch["rewards"].mean()), "seqs": batch.batch_size[0],
            "gen_tokens": int(batch["loss_mask"].sum()), "advantage_abs_mean": advantage_abs_mean(batch),
            "staleness_mean": lag["mean_lag"], "staleness_max": lag["max_lag"],
            "token_versions": sorted(set(batch["versions"][batch["loss_mask"]].tolist())),
            "episode_ids": sorted(set(batch["group_id"].tolist())), "data_sha": prompts_digest(batch),
            "batch_bytes": int(batch.bytes()), **reward_component_means(batch), **teacher_kl_stats(batch)}


def advantage_abs_mean(batch) -> float:
    """Mean |advantage| over the rows `[N]`, or over the sampled tokens of per-token advantages `[N, T]`."""
    adv = batch["advantages"]
    return float(adv[batch["loss_mask"].bool()].abs().mean() if adv.dim() == 2 else adv.abs().mean())


def teacher_kl_stats(batch) -> dict[str, float]:
    """The teacher KL of a distillation batch over its sampled tokens: mean and per-token quantiles ({} without)."""
    if "teacher_kl" not in batch.keys():
        return {}
    kl = batch["teacher_kl"][batch["loss_mask"].bool()].double()
    if kl.numel() == 0:
        return {"teacher_kl_mean": 0.0}
    q = quantiles(kl, (0.1, 0.5, 0.9))
    return {"teacher_kl_mean": float(kl.mean()), "teacher_kl_p10": q[0], "teacher_kl_p50": q[1],
            "teacher_kl_p90": q[2]}


def quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """`torch.quantile`'s linear interpolation of a 1-D tensor, by sorting (torch.quantile refuses > 2**24 values)."""
    v, n = values.sort().values, values.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        out.append(float(v[lo] + (pos - lo) * (v[hi] - v[lo])))
    return out


def prompts_digest(batch) -> str:
    """Hash of the prompts a batch trains on, in group order (to check resume keeps data order)."""
    h = hashlib.sha1()
    for gid in sorted(set(batch["group_id"].tolist())):
        row = batch["input_ids"][batch["group_id"] == gid][0]
        first_gen = int(batch["loss_mask"][batch["group_id"] == gid][0].float().argmax())
        h.update(str(row[:first_gen].tolist()).encode())
    return h.hexdigest()[:16]
