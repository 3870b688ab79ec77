"""The job's `reward.*` section: a reward model and a generative judge beside the task's rule reward.

Both are off by default (an empty `path`), so a job without a `reward` section trains on its task's
rule reward exactly as before. `RewardConfig.check()` runs inside `GRPOJobConfig.validate()`: every
error names the key, before any actor starts. What the local backend allows is the job's own check
(job/checks.py), not this section's.
"""
from __future__ import annotations

import dataclasses
import math
import re
import string
from typing import Any, Literal

from rayllm_rl.config import NonNegFloat, NonNegInt, PosFloat, PosInt

DEFAULT_JUDGE_TEMPLATE = ("Question: {question}\nProposed answer: {completion}\nIs the proposed answer correct? "
                          "Reply 'Score: N' with N from 0 (wrong) to 10 (right).")
"""The judge's default prompt: the row's last user message and the policy's completion."""

DEFAULT_JUDGE_REGEX = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
"""The default `regex` parser: the first number after 'Score'."""

TEMPLATE_FIELDS = ("question", "completion", "prompt")
"""Fields every judge template may use; a row's own fields (e.g. `answer`) may be used too."""


@dataclasses.dataclass
class RewardModelConfig:
    """A sequence-classification reward model (one output per sequence) served by `reward-model-<i>` actors."""

    path: str = ""
    """A local HF model directory or hub id of an `AutoModelForSequenceClassification` with num_labels=1
    (e.g. a Skywork/ArmoRM-style RM); empty = off."""
    num_actors: PosInt = 1
    """`reward-model-<i>` actors (Ray backend); env workers send each request to the least-busy one."""
    gpus_per_actor: float = 0.0
    """GPUs each reward-model actor asks Ray for (0 = CPU; a fraction shares a GPU; above 1, whole numbers)."""
    batch_size: PosInt = 32
    """Score requests gathered into one forward (at most)."""
    batch_wait_s: NonNegFloat = 0.005
    """Seconds an actor waits for more requests after the first one before it runs a forward."""
    timeout_s: PosFloat = 60.0
    """Longest wait for one score (queueing included); past it the score is 0 and reward_model_timeouts += 1."""
    weight: float = 1.0
    """Weight of the reward model's score in the trained reward."""
    activation: Literal["identity", "sigmoid"] = "identity"
    """Applied to the model's logit: 'identity' (the raw score, what RMs trained with Bradley-Terry give) or
    'sigmoid' (a probability, for a classifier trained with binary cross-entropy)."""
    max_length: NonNegInt = 0
    """Tokens the model reads of each conversation (the end is kept); 0 = the model's max_position_embeddings."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights of the reward model."""


@dataclasses.dataclass
class JudgeConfig:
    """A generative judge: an LLM served by its own `judge-<i>` engine replicas, asked to grade each completion."""

    path: str = ""
    """A local HF causal LM directory or hub id; empty = off."""
    engine: str = "transformers"
    """Engine of the judge's replicas, a name of the engine registry (inference/registry.py)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The judge engine's own options (the same keys as inference.options for that engine)."""
    num_replicas: PosInt = 1
    """`judge-<i>` replica actors (Ray backend); they never receive weight updates."""
    gpus_per_replica: float = 0.0
    """GPUs each judge replica asks Ray for (0 = CPU)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights of the judge model."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message, a Python format string: {question} (the row's last user message), {completion},
    {prompt} (the policy's whole prompt text) and any field of the dataset row (e.g. {answer}); it must use
    {completion}. Sent through the judge tokenizer's chat template when it has one."""
    system_prompt: str = ""
    """A system message before the template (empty = none)."""
    parser: Literal["regex", "yes_no"] = "regex"
    """How the judge's text becomes a score: 'regex' (the first match of `regex`, its group 1 a number in
    [min_score, max_score], scaled to [0, 1]) or 'yes_no' (the first word 'yes' -> 1, 'no' -> 0)."""
    regex: str = DEFAULT_JUDGE_REGEX
    """The 'regex' parser's pattern; group 1 must capture the number."""
    min_score: float = 0.0
    """'regex': the lowest score the judge may give (scaled to 0)."""
    max_score: float = 10.0
    """'regex': the highest score the judge may give (scaled to 1); a number outside the range is garbage (0)."""
    max_new_tokens: PosInt = 32
    """Tokens the judge may generate (greedy) per completion."""
    timeout_s: PosFloat = 120.0
    """Longest wait for one verdict; past it the score is 0 and reward_judge_timeouts += 1."""
    weight: float = 1.0
    """Weight of the judge's score in the trained reward."""


@dataclasses.dataclass
class RewardConfig:
    """What the policy is trained on: rule_weight * the task's rule + model.weight * RM + judge.weight * judge.
    Evaluation always scores with the task's rule alone."""

    fn: list[str] = dataclasses.field(default_factory=list)
    """Your reward, the rule of task=prompts: 'package.module:function', or several `[a.b:f,a.b:g]` (summed with
    `fn_weights`), each `fn(prompt, completion, prompt_ids, completion_ids, **columns) -> float | {"reward": float,
    **components}`, sync or async (rewards/user_reward.py). Setting it with `task` unset trains task=prompts on
    data.path's rows. From Python: train(reward_fn=...)."""
    fn_weights: list[float] = dataclasses.field(default_factory=list)
    """One weight per `fn` (TRL's reward_weights): the reward is their weighted sum, each function's own value
    logged as reward_<name>; empty = all 1.0."""
    rule_weight: float = 1.0
    """Weight of the task's rule reward (0 = trained on the reward model and/or judge alone; the rule is
    still computed and logged as reward_rule)."""
    model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    """Sequence-classification reward model."""
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)
    """Generative judge."""

    @property
    def enabled(self) -> bool:
        """Whether a reward model or a judge is on (else the task's rule alone, unweighted)."""
        return bool(self.model.path or self.judge.path)

    def parts(self) -> dict[str, float]:
        """{"model": weight, "judge": weight} of the parts that are on."""
        return {name: getattr(self, name).weight for name in ("model", "judge") if getattr(self, name).path}

    def check(self, environment: bool = True) -> None:
        """Cross-field checks, each error naming its key; `environment` False skips what depends on this
        machine (the judge engine's package installed)."""
        for name, section, default in (("model", self.model, RewardModelConfig()),
                                       ("judge", self.judge, JudgeConfig())):
            if not section.path:
                changed = [f.name for f in dataclasses.fields(section)
                           if getattr(section, f.name) != getattr(default, f.name)]
                if changed:
                    raise ValueError(f"reward.{name}.{changed[0]} is read only when reward.{name}.path is set "
                                     f"(reward.{name} is off)")
        if not self.enabled:
            if self.rule_weight != 1.0:
                raise ValueError(f"reward.rule_weight={self.rule_weight} weighs the rule against reward.model or "
                                 "reward.judge; neither is on (set reward.model.path or reward.judge.path)")
            return
        weights = {"reward.rule_weight": self.rule_weight,
                   **{f"reward.{name}.weight": w for name, w in self.parts().items()}}
        for key, w in weights.items():
            if not math.isfinite(w):
                raise ValueError(f"{key}={w}: must be a finite number")
        if all(w == 0 for w in weights.values()):
            raise ValueError(f"every reward weight is 0 ({weights}): the policy would be trained on nothing")
        if self.model.path:
            self._check_model()
        if self.judge.path:
            self._check_judge(environment)

    def _check_model(self) -> None:
        m = self.model  # its counts and timeouts have their limits in their types
        _check_gpus("reward.model.gpus_per_actor", m.gpus_per_actor)

    def _check_judge(self, environment: bool) -> None:
        from rayllm_rl.inference.registry import ENGINES, EngineJob, job_side

        j = self.judge
        _check_gpus("reward.judge.gpus_per_replica", j.gpus_per_replica)
        if j.engine not in ENGINES:
            raise ValueError(f"reward.judge.engine must be one of {tuple(ENGINES)}, got {j.engine!r}")
        options = judge_engine_options(j)  # an unknown option fails here
        try:  # what the engine refuses, said in the judge's keys
            job_side(j.engine).check_job(EngineJob(
                gpus_per_replica=j.gpus_per_replica, tensor_parallel_size=1, dtype=j.dtype,
                environment=environment, options=options))
        except ValueError as exc:
            raise ValueError(_judge_keys(str(exc))) from None
        check_template(j.template)
        if j.parser == "regex":
            try:
                pattern = re.compile(j.regex)
            except re.error as exc:
                raise ValueError(f"reward.judge.regex={j.regex!r} is not a valid regular expression: {exc}") from None
            if pattern.groups < 1:
                raise ValueError(f"reward.judge.regex={j.regex!r} has no group: group 1 must capture the score")
            if not j.min_score < j.max_score:
                raise ValueError(f"reward.judge.min_score={j.min_score} must be < reward.judge.max_score={j.max_score}")


def judge_engine_options(judge: JudgeConfig):
    """`reward.judge.options` typed into the judge engine's `Options` (an unknown key names itself)."""
    from rayllm_rl.config import ConfigError, apply_dict
    from rayllm_rl.inference.registry import job_side

    try:
        return apply_dict(job_side(judge.engine).Options(), dict(judge.options), prefix="reward.judge.options.")
    except ConfigError as exc:
        raise ValueError(f"{exc} (the options of reward.judge.engine={judge.engine})") from None


def _judge_keys(message: str) -> str:
    """An engine's `check_job` message about the policy's replicas, in the keys of the judge's."""
    for policy_key, judge_key in (("ray.gpus_per_replica", "reward.judge.gpus_per_replica"),
                                  ("inference.options", "reward.judge.options"), ("model.dtype", "reward.judge.dtype"),
                                  ("inference.engine", "reward.judge.engine")):
        message = message.replace(policy_key, judge_key)
    return message


def check_template(template: str) -> tuple[str, ...]:
    """The field names `template` uses; ValueError naming reward.judge.template if it does not parse,
    uses a positional or attribute/index field, or never uses {completion}."""
    try:
        names = tuple(name for _, name, _, _ in string.Formatter().parse(template) if name is not None)
    except ValueError as exc:
        raise ValueError(f"reward.judge.template does not parse as a format string ({exc}): "
                         f"{template!r:.120}") from None
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise ValueError(f"reward.judge.template uses {{{bad[0]}}}: fields must be names ({', '.join(TEMPLATE_FIELDS)} "
                         "or a dataset row's field)")
    if "completion" not in names:
        raise ValueError("reward.judge.template must use {completion} (the policy's answer the judge grades)")
    return names


def _check_gpus(key: str, gpus: float) -> None:
    if gpus < 0 or (gpus > 1 and not float(gpus).is_integer()):
        raise ValueError(f"{key}={gpus}: must be 0 (CPU), a fraction of one GPU, or a whole number of GPUs")
