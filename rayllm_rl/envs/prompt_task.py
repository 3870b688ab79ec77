"""`task=prompts`: train on the user's prompt rows with the user's reward function(s).

Rows come from `data.path` (any local file, folder or hub dataset `load_rows` reads) or `train(train_dataset=
...)`; the prompt is the column `data.prompt_column` (default `messages`): a chat (a list of {role, content})
or a plain string, made a single user message. `data.system_prompt`, if set, is put before every prompt
that has no system message of its own. Each row's prompt chat goes to the `messages` column, which the
workflows render under the model's own chat template. The reward is `reward.fn` / `train(reward_fn=...)`
(`rewards/user_reward.py`): it gets every other column as a keyword argument, and is called once on the
first training row (the empty completion) before any actor starts, so a wrong signature, a raising
reward or one returning no number fails at once, naming it. `data.sft_column`, if set, holds each row's
demonstration text for the SFT warm start.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from rayllm_rl.envs.task import Task, load_split_rows
from rayllm_rl.envs.task_registry import PROMPT_TASK, TASKS

MESSAGES = "messages"
"""The column the workflows read the prompt chat from."""


def prompt_messages(column: str, system_prompt: str, row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The prompt chat of a row: its `column` as a chat or as one user message, `system_prompt` first if set and
    the chat has no system message."""
    value = row[column]
    chat = [{"role": "user", "content": value}] if isinstance(value, str) else \
        [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    if system_prompt and not any(m["role"] == "system" for m in chat):
        chat = [{"role": "system", "content": system_prompt}, *chat]
    return chat


def check_prompt_row(column: str, sft_column: str, row: Mapping[str, Any]) -> None:
    """ValueError unless the row has its prompt in `column` (a non-empty string or a list of {role, content}
    messages) and, with `sft_column`, a demonstration string; `load_rows` adds the file and line."""
    if column not in row:
        raise ValueError(f"no column {column!r} (data.prompt_column) to take the prompt from; the columns are "
                         f"{sorted(row)}: set data.prompt_column to the one holding the prompt")
    if column != MESSAGES and MESSAGES in row:
        raise ValueError(f"a column {MESSAGES!r} beside data.prompt_column={column!r}: the prompt task puts each row's "
                         f"prompt chat in {MESSAGES!r}; rename that column, or set data.prompt_column={MESSAGES}")
    value = row[column]
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"the prompt column {column!r} (data.prompt_column) is empty")
    elif not (isinstance(value, list) and value and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value)):
        raise ValueError(f"the prompt column {column!r} (data.prompt_column) holds {value!r:.120}: expected a string "
                         "or a chat, a list of {'role': str, 'content': str} messages")
    if sft_column and not (isinstance(row.get(sft_column), str) and row[sft_column].strip()):
        raise ValueError(f"the demonstration column {sft_column!r} (data.sft_column) is "
                         + ("missing" if sft_column not in row else f"{row[sft_column]!r:.80}, not a non-empty string")
                         + f"; the columns are {sorted(row)}")


def column_text(column: str, row: Mapping[str, Any]) -> str:
    """The SFT demonstration of a row: its `column`."""
    return str(row[column])


def chat_text(messages: list[Mapping[str, str]]) -> str:
    """A prompt chat as plain text (the probe's `prompt`; at run time it is the template-rendered prompt)."""
    return "\n".join(str(m["content"]) for m in messages)


def make_prompt_task(data_cfg: Any, seed: int = 0, inputs: Any = None) -> Task:
    """The registry's factory of `task=prompts`: the user's rows, checked and split (`load_split_rows`: no eval
    prompt is a training prompt), scored by the user's reward functions (`inputs.reward_fns`, weighted by
    `inputs.reward_weights`), each probed on the first training row."""
    from rayllm_rl.rewards.user_reward import UserReward, probe

    fns = tuple(getattr(inputs, "reward_fns", ()) or ())
    if not fns:
        raise ValueError(f"task={PROMPT_TASK} scores with your reward: set reward.fn=package.module:function (or pass "
                         "train(reward_fn=...)); none was given")
    column, sft_column = data_cfg.prompt_column, data_cfg.sft_column
    train, eval_ = load_split_rows(
        data_cfg, seed, inputs, task=PROMPT_TASK,
        make_messages=functools.partial(prompt_messages, column, data_cfg.system_prompt),
        check_row=functools.partial(check_prompt_row, column, sft_column), example_path=TASKS[PROMPT_TASK].example_path)
    if len(train) == 0:
        raise ValueError("no training rows are left once the held-out prompts are taken out; give more rows")
    columns = [c for c in train.column_names if c not in (column, MESSAGES)]
    reward = UserReward(fns, getattr(inputs, "reward_weights", None) or None, columns)
    labels = getattr(inputs, "reward_labels", None) or [f"reward function {n!r}" for n in reward.names]
    first = train[0]
    reward.declare([probe(fn, label, chat_text(first[MESSAGES]), reward.row_kwargs(first))
                    for fn, label in zip(fns, labels)])
    sft_target = functools.partial(column_text, sft_column) if sft_column else None
    return Task(PROMPT_TASK, train, eval_, reward, sft_target)


def plan_rows(data_cfg: Any, inputs: Any) -> dict[str, Any]:
    """{"rows": what was checked}, for the dry run's data plan: the checks of the prompt task's local sources,
    reading no more than they need: the first row of `data.path` (its prompt column, and each reward function
    called on it, as at start); with `data.path` and `data.eval_path` both JSON/JSONL files, whether they
    share prompts (streamed, nothing cached). A hub
    dataset or a folder of files is not read: the job checks it when it starts."""
    from rayllm_rl.data.sources import first_row, json_file_rows
    from rayllm_rl.envs.task import prompt_key, refuse_shared_prompts
    from rayllm_rl.rewards.user_reward import UserReward, probe

    column, make = data_cfg.prompt_column, functools.partial(prompt_messages, data_cfg.prompt_column,
                                                             data_cfg.system_prompt)
    row = first_row(data_cfg.path, data_cfg.split) if data_cfg.path else None
    if row is None:
        return {"rows": {"status": "not read by the dry run (a hub dataset, a folder or rows given in Python): "
                                   "checked when the job starts"}}
    try:
        check_prompt_row(column, data_cfg.sft_column, row)
    except ValueError as err:
        raise ValueError(f"data.path={data_cfg.path!r}, first row: {err}") from None
    fns = tuple(getattr(inputs, "reward_fns", ()) or ())
    reward = UserReward(fns, getattr(inputs, "reward_weights", None) or None, [c for c in row if c != column])
    labels = getattr(inputs, "reward_labels", None) or reward.names
    reward.declare([probe(fn, label, chat_text(make(row)), reward.row_kwargs(row)) for fn, label in zip(fns, labels)])
    out = {"status": f"first row checked: prompt column {column!r}, reward {reward!r} scores it, components "
                     f"{list(reward.component_keys)}"}
    train_rows = json_file_rows(data_cfg.path)
    eval_rows = json_file_rows(data_cfg.eval_path) if data_cfg.eval_path else None
    if train_rows is not None and eval_rows is not None:
        def prompts(rows) -> set[str]:  # a malformed row is the job's to report, naming its line
            return {prompt_key(make(r)) for r in rows if isinstance(r, Mapping) and _is_valid(column, r)}

        refuse_shared_prompts(prompts(train_rows), prompts(eval_rows), f"data.eval_path={data_cfg.eval_path!r}",
                              f"data.path={data_cfg.path!r}")
        out["status"] += "; no eval prompt is a training prompt"
    return {"rows": out}


def _is_valid(column: str, row: Mapping[str, Any]) -> bool:
    try:
        check_prompt_row(column, "", row)
    except ValueError:
        return False
    return True
