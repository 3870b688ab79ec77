"""`task=reasoning_gym`: one of reasoning-gym's procedural generators as a training task.

Training rows come from the generator with `data.reasoning_gym.seed`, held-out rows with `eval_seed`
(they must differ), and every training row whose question is also an eval question is dropped, so
the evaluation scores only questions the policy never trained on. Rows are plain arrow columns
(`question`, `answer`, `messages`, `rg_seed`, `rg_size`, `rg_index`); the scorer regenerates the
full entry (metadata included) from the last three (`rewards/reasoning_gym.py`). The prompt is the
question (plus `instruction`) as the user's message, under the model's own chat template: with no
`system_prompt` the template supplies its default system line.
"""
from __future__ import annotations

import dataclasses
import logging
import typing
from typing import Any

from rayllm_rl.envs.dataset_envs import DatasetChatEnv

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ReasoningGymConfig:
    """task=reasoning_gym: which generator, its options and seeds, and how prompts and rewards are made."""

    dataset: str = "chain_sum"
    """A reasoning-gym generator name (`reasoning_gym.factory.DATASETS`: basic_arithmetic, chain_sum,
    gsm_symbolic, countdown, ... 100+); an unknown name fails listing the close ones."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The generator's own options (fields of its config class, e.g. chain_sum's min_terms, max_terms,
    min_digits, max_digits); an unknown option fails naming the valid ones. Values are converted to the
    option's type, so `data.reasoning_gym.options.max_terms=2` works from the command line."""
    train_size: int = 20000
    """Training rows generated (before the eval questions are dropped from them)."""
    seed: int = 1
    """Generator seed of the training rows."""
    eval_seed: int = 2
    """Generator seed of the held-out rows (`data.eval_size` of them); must differ from `seed`."""
    instruction: str = ""
    """Text appended to every question (after a space), e.g. "Answer with a number."; empty = none."""
    system_prompt: str = ""
    """A system message for every prompt; empty = none, so the chat template's own default applies
    (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face")."""
    format_weight: float = 0.0
    """Added to the reward when the answer comes inside <answer></answer> tags (0 = the scorer alone)."""

    def check(self) -> None:
        """Errors naming the key: an unknown generator or option, equal seeds, sizes or weights out of range.
        The options are converted to their types in place (command-line text becomes ints, lists, ...)."""
        self.options = generator_options(self)
        if self.seed == self.eval_seed:
            raise ValueError(f"data.reasoning_gym.seed and eval_seed are both {self.seed}: the held-out rows would be "
                             "the training rows; give them different seeds")
        if self.train_size < 1:
            raise ValueError(f"data.reasoning_gym.train_size={self.train_size}: must be >= 1")
        if self.format_weight < 0:
            raise ValueError(f"data.reasoning_gym.format_weight={self.format_weight}: must be >= 0")


def generator_options(cfg: ReasoningGymConfig) -> dict[str, Any]:
    """`cfg.options` checked against the generator's config class and converted to its field types."""
    from reasoning_gym.factory import DATASETS

    from rayllm_rl.config import ConfigError, coerce

    if cfg.dataset not in DATASETS:
        import difflib

        close = difflib.get_close_matches(cfg.dataset, list(DATASETS), n=5, cutoff=0.5)
        raise ValueError(f"data.reasoning_gym.dataset={cfg.dataset!r} is not a reasoning-gym generator"
                         + (f"; close ones: {close}" if close
                            else f"; {len(DATASETS)} exist, e.g. {sorted(DATASETS)[:8]}"))
    config_cls = DATASETS[cfg.dataset][1]
    hints = typing.get_type_hints(config_cls)
    valid = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
    out: dict[str, Any] = {}
    for key, value in cfg.options.items():
        if key not in valid:
            raise ValueError(f"data.reasoning_gym.options.{key}: {cfg.dataset} has no such option (it takes {valid}; "
                             "seed and size come from data.reasoning_gym.seed/eval_seed/train_size)")
        try:
            out[key] = coerce(value, hints[key], f"data.reasoning_gym.options.{key}")
        except ConfigError as error:
            raise ValueError(str(error)) from None
    try:  # the generator's own checks (e.g. min_terms <= max_terms) run on construction
        config = config_cls(**out, seed=cfg.seed, size=1)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as error:
        raise ValueError(f"data.reasoning_gym.options={out} are refused by {cfg.dataset}: "
                         f"{error or type(error).__name__}") from None
    return out


def messages(cfg: ReasoningGymConfig, question: str) -> list[dict[str, str]]:
    """The prompt chat of one question: [system (if set),] user = question [+ " " + instruction]."""
    user = question if not cfg.instruction else f"{question} {cfg.instruction}"
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return system + [{"role": "user", "content": user}]


def _rows(cfg: ReasoningGymConfig, options: dict[str, Any], seed: int, size: int) -> list[dict[str, Any]]:
    from rayllm_rl.rewards.reasoning_gym import cached_dataset, options_key

    data = cached_dataset(cfg.dataset, options_key(options), seed, size)
    return [{"question": e["question"], "answer": str(e["answer"]), "messages": messages(cfg, e["question"]),
             "rg_seed": seed, "rg_size": size, "rg_index": i} for i, e in enumerate(data)]


def make_splits(cfg: ReasoningGymConfig, eval_size: int):
    """(train, eval) `datasets.Dataset`s: `eval_size` rows of `eval_seed`, and the `train_size` rows of `seed`
    minus any whose question is an eval question (and minus repeats of a question). Too few training
    rows left (fewer than a tenth of train_size) fails: the generator's space is too small for them."""
    from datasets import Dataset

    cfg.check()
    options = generator_options(cfg)
    held = _rows(cfg, options, cfg.eval_seed, eval_size) if eval_size > 0 else []
    seen = {r["question"] for r in held}
    train = []
    for row in _rows(cfg, options, cfg.seed, cfg.train_size):
        if row["question"] not in seen:
            seen.add(row["question"])
            train.append(row)
    dropped = cfg.train_size - len(train)
    if len(train) < max(1, cfg.train_size // 10):
        raise ValueError(f"reasoning-gym {cfg.dataset} with options {options}: only {len(train)} of "
                         f"data.reasoning_gym.train_size={cfg.train_size} training rows are distinct questions that "
                         f"are not among the {len(held)} eval questions; the generator's question space is too "
                         "small for these sizes: widen its options (more digits or terms) or lower the sizes")
    if dropped:
        log.info("reasoning-gym %s: dropped %d of %d training rows (eval questions or repeats)", cfg.dataset, dropped,
                 cfg.train_size)
    return Dataset.from_list(train), Dataset.from_list(held) if held else Dataset.from_list(train).select([])


def make_reward(cfg: ReasoningGymConfig):
    from rayllm_rl.rewards.reasoning_gym import ReasoningGymReward

    return ReasoningGymReward(cfg.dataset, generator_options(cfg), cfg.format_weight)


class ReasoningGymEnv(DatasetChatEnv):
    """A reasoning-gym task as a ChatEnv (the `env` workflow): rows carry their prompt chat in `messages`
    and are scored by `ReasoningGymReward`."""

    required_fields = ("question", "answer", "messages", "rg_seed", "rg_size", "rg_index")

    def __init__(self, dataset: Any, tokenizer, **kwargs: Any) -> None:
        if "reward_fn" not in kwargs:
            raise ValueError("ReasoningGymEnv needs reward_fn=ReasoningGymReward(...) (make_reward(cfg) builds it)")
        super().__init__(dataset, tokenizer, prompt_key="messages", **kwargs)


def make_task(data_cfg: Any = None, seed: int = 0, inputs: Any = None):
    """The registry's factory (`task=reasoning_gym`): `data.reasoning_gym`'s generator, `data.eval_size` held-out
    rows of its eval seed (200 without a DataConfig), scored by the generator's own scorer."""
    from rayllm_rl.envs.task import Task, in_memory

    cfg = ReasoningGymConfig() if data_cfg is None else data_cfg.reasoning_gym
    train, eval_ = make_splits(cfg, 200 if data_cfg is None else data_cfg.eval_size)
    return Task("reasoning_gym", in_memory(train), in_memory(eval_), make_reward(cfg), None, ReasoningGymEnv)


def plan_rows(data_cfg: Any, inputs: Any = None) -> dict[str, Any]:
    """What the dry run says of the generated rows (generated on the driver at start: nothing read or downloaded)."""
    rg = data_cfg.reasoning_gym
    source = f"reasoning-gym {rg.dataset} {rg.options}"
    return {"train": {"kind": "generator", "source": source,
                      "status": f"{rg.train_size} rows of seed {rg.seed}, minus the eval questions"},
            "eval": {"kind": "generator", "source": source,
                     "status": f"{data_cfg.eval_size} rows of seed {rg.eval_seed}"}}
