"""Task environments: a ChatEnv fed from a `datasets` source, scored by a task reward.

`DatasetChatEnv` = ChatEnv + DataLoadingPrimer (rows from any `datasets` source, each prompt
repeated `repeats` times for group sampling) + RewardTransform (+ IncrementalTokenizer in
history mode), as TorchRL's DatasetChatEnv. `GSM8KEnv`, `MATHEnv` and `IFEvalEnv` fix the prompt
format and the reward of their dataset. In the pipeline the collector picks the rows and an env
worker runs one of these envs per episode through `ChatEnvWorkflow`, built with `dataset=None`:
the env then holds no dataset and takes the row each reset carries (`RowFedPrimer`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from rayllm_rl.data.sources import RowCheck, check_fields, load_rows
from rayllm_rl.envs.chat_env import ChatEnv
from rayllm_rl.envs.transforms import DataLoadingPrimer, RewardTransform, Transform

THINK_ANSWER_SYSTEM = (
    "Reason step by step inside <think> </think>, then give only the final answer inside "
    "<answer> </answer>."
)


def math_prompt(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """MATH prompt chat: the think/answer instruction, then the problem (answers in LaTeX)."""
    return [{"role": "system", "content": THINK_ANSWER_SYSTEM + " Write the answer in LaTeX."},
            {"role": "user", "content": str(row["problem"])}]


def ifeval_prompt(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """IFEval prompt chat: the think/answer instruction, then the instruction-following prompt."""
    return [{"role": "system", "content": "Think inside <think> </think>, then write your response inside "
             "<answer> </answer>, following every instruction of the user."},
            {"role": "user", "content": str(row["prompt"])}]


def gsm8k_messages(row: Mapping[str, Any]) -> list[dict[str, str]]:
    from rayllm_rl.rewards.gsm8k import gsm8k_prompt

    return gsm8k_prompt(str(row["question"]))


def check_gsm8k_row(row: Mapping[str, Any]) -> None:
    """ValueError unless `answer` holds the final number: '<reasoning> #### N' or a bare number."""
    from rayllm_rl.rewards.gsm8k import gsm8k_final_answer, normalize_number

    answer = str(row["answer"])
    if "####" in answer:
        gsm8k_final_answer(answer)
    elif normalize_number(answer) is None:
        raise ValueError(f"field 'answer' holds no number: {answer[:120]!r}; expected '<reasoning> #### N' or a number")


def check_math_row(row: Mapping[str, Any]) -> None:
    """ValueError unless the row has a reference answer: `answer`, or a `solution` with \\boxed{...}."""
    from rayllm_rl.rewards.math_answer import math_reference_answer

    math_reference_answer(dict(row))


def check_ifeval_row(row: Mapping[str, Any]) -> None:
    """ValueError unless `instruction_id_list` lists known ids and `kwargs` (optional) has one dict per id."""
    from rayllm_rl.rewards.ifeval import normalize_instruction_ids, normalize_kwargs

    ids = normalize_instruction_ids(row["instruction_id_list"])
    normalize_kwargs(row.get("kwargs"), len(ids))


class RowFedPrimer(DataLoadingPrimer):
    """The primer of an env whose caller picks every row (an env worker, fed by the collector): no
    dataset of its own, so nothing is loaded or pickled per worker. A reset must carry a `"row"`;
    one without raises ValueError. `_prompt_of` builds the prompt chat of a given row as usual."""

    def __init__(self, *, prompt_key: str | Callable[[dict], Any] = "messages", batch_size: int | None = None):
        Transform.__init__(self)  # DataLoadingPrimer's own init needs a non-empty dataset
        self.dataset, self.prompt_key, self.batch_size, self.repeats = (), prompt_key, batch_size, 1

    def sample(self, n: int | None = None) -> list:
        raise ValueError("this env holds no dataset (built with dataset=None): reset it with a 'row' per element, "
                         "as ChatEnvWorkflow does with the row the collector hands it")

    def __repr__(self) -> str:
        return "RowFedPrimer()"


class DatasetChatEnv(ChatEnv):
    """A ChatEnv whose prompts come from a dataset and whose steps are scored by `reward_fn`.

    `dataset` is a `datasets.Dataset`, a source for `load_rows` (local file, save_to_disk folder,
    hub name), or None: then every reset must carry its row (`RowFedPrimer`), which is how env
    workers run it (rows come from the driver's collector). `make_messages(row)` builds the prompt chat
    (default: the row's `prompt_key` field, a str or a chat). `repeats` = GRPO group size. `required_fields` and
    `check_row` (a RowCheck) are applied to every row up front, so a malformed row fails at load
    time with its file and line (or row), not mid-run. A task env sets both as class attributes.
    """

    required_fields: tuple[str, ...] = ()
    check_row: RowCheck | None = None

    def __init__(
        self,
        dataset: Any,
        tokenizer,
        *,
        reward_fn: Callable[..., Any] | None = None,
        make_messages: Callable[[Mapping[str, Any]], list[dict[str, str]]] | None = None,
        prompt_key: str = "messages",
        required_fields: tuple[str, ...] = (),
        check_row: RowCheck | None = None,
        repeats: int = 1,
        batch_size: int = 1,
        split: str = "train",
        shuffle: bool = True,
        seed: int = 0,
        input_mode: str = "history",
        system_prompt: str | None = None,
        set_done: bool | Callable[[str], bool] = True,
        reward_timeout_s: float = 30.0,
        check_rows: bool = True,
    ) -> None:
        required_fields = tuple(required_fields) or type(self).required_fields
        check_row = check_row or type(self).check_row
        if isinstance(dataset, str):
            dataset = load_rows(dataset, split, required=required_fields if check_rows else (),
                                check_row=check_row if check_rows else None)
        elif dataset is not None and check_rows:  # rows given per reset were checked where they were loaded
            check_fields(dataset, required_fields, type(self).__name__, check_row)
        self.dataset = dataset
        self.reward_fn = reward_fn
        self.make_messages = make_messages
        super().__init__(tokenizer, input_mode=input_mode, system_prompt=system_prompt, batch_size=batch_size,
                         with_tokenizer=False)
        key: Any = make_messages if make_messages is not None else prompt_key
        self.primer = RowFedPrimer(prompt_key=key, batch_size=batch_size) if dataset is None else DataLoadingPrimer(
            dataset, prompt_key=key, batch_size=batch_size, repeats=repeats, shuffle=shuffle, seed=seed)
        self.append_transform(self.primer)
        self.reward_transform = None
        if reward_fn is not None:
            self.reward_transform = RewardTransform(reward_fn, set_done=set_done, timeout_s=reward_timeout_s)
            self.append_transform(self.reward_transform)
        if input_mode == "history":
            from rayllm_rl.envs.transforms import IncrementalTokenizer

            self.append_transform(IncrementalTokenizer(tokenizer))

    def messages_of(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """The prompt chat of a row (what the primer would build), for callers that pick rows."""
        prompt = self.primer._prompt_of(-1, row)
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


class GSM8KEnv(DatasetChatEnv):
    """GSM8K (`question`, `answer` ending in `#### N`) with GSM8KRewardParser's components."""

    required_fields = ("question", "answer")
    check_row = staticmethod(check_gsm8k_row)

    def __init__(self, dataset: Any, tokenizer, **kwargs: Any) -> None:
        from rayllm_rl.rewards.gsm8k import GSM8KRewardParser

        kwargs.setdefault("reward_fn", GSM8KRewardParser())
        super().__init__(dataset, tokenizer, make_messages=gsm8k_messages, **kwargs)


class MATHEnv(DatasetChatEnv):
    """MATH (`problem` + `solution` with a boxed answer, or MATH-500's `answer`), checked by math-verify
    in a separate process with a timeout (MathRewardFn)."""

    required_fields = ("problem",)
    check_row = staticmethod(check_math_row)

    def __init__(self, dataset: Any, tokenizer, **kwargs: Any) -> None:
        from rayllm_rl.rewards.math_answer import MathRewardFn

        kwargs.setdefault("reward_fn", MathRewardFn())
        super().__init__(dataset, tokenizer, make_messages=math_prompt, **kwargs)


class IFEvalEnv(DatasetChatEnv):
    """IFEval (`prompt`, `instruction_id_list`, `kwargs`) scored by IFEvalScorer; an episode is done
    once the response holds an answer block."""

    required_fields = ("prompt", "instruction_id_list")
    check_row = staticmethod(check_ifeval_row)

    def __init__(self, dataset: Any, tokenizer, **kwargs: Any) -> None:
        from rayllm_rl.rewards.ifeval import IFEvalScorer

        scorer = kwargs.setdefault("reward_fn", IFEvalScorer())
        kwargs.setdefault("set_done", getattr(getattr(scorer, "reward_fn", scorer), "done", True))
        super().__init__(dataset, tokenizer, make_messages=ifeval_prompt, **kwargs)


ENVS: dict[str, type[DatasetChatEnv]] = {"gsm8k": GSM8KEnv, "math": MATHEnv, "ifeval": IFEvalEnv}
