"""Example agents written against the OpenAI SDK (plain agent code, nothing rayllm-specific).

Used by `rollout.workflow=openai_agent rollout.agent=rayllm_rl.agents.examples:<name>`; the
task's reward function scores the agent's last completion.
"""
from __future__ import annotations

from typing import Any, Mapping


def _messages(data: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = data.get("messages")
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) for m in messages]


async def answer_then_check(client, data: Mapping[str, Any]) -> None:
    """Answer, then answer again after a 'check your answer' turn in the same conversation."""
    messages = _messages(data)
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Check your answer and give it again."}]
    await client.chat.completions.create(model="policy", messages=messages)
