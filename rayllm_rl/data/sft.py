"""SFT batches: chat conversations -> trajectory TensorDict whose loss_mask marks assistant tokens."""
from __future__ import annotations

import torch
from tensordict import TensorDict

from rayllm_rl.data.trajectory import concat_padded, make_trajectory


def make_sft_batch(tokenizer, chats: list[list[dict[str, str]]]) -> TensorDict:
    """Tokenize full chats with the chat template; loss only on the assistant's tokens.

    Needs a template with `{% generation %}` marks (HF `return_assistant_tokens_mask`).
    Carries zero `advantages` so it goes through the same learner step as RL batches.
    """
    parts = []
    for chat in chats:
        enc = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, amask = list(enc["input_ids"]), list(enc["assistant_masks"])
        if not any(amask):
            raise ValueError(f"SFT chat has no assistant tokens (template lacks generation marks?): {chat!r:.200}")
        parts.append(make_trajectory(ids, [0.0] * len(ids), amask, [-1] * len(ids), reward=0.0))
    batch = concat_padded(parts)
    batch["advantages"] = torch.zeros(batch.batch_size[0])
    return batch
