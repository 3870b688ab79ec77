"""SFT batches: chat conversations -> trajectory TensorDict whose loss_mask marks assistant tokens."""
from __future__ import annotations

import torch
from tensordict import TensorDict

from rayllm_rl.data.chat_template import assistant_token_mask
from rayllm_rl.data.trajectory import concat_padded, make_trajectory


def make_sft_batch(tokenizer, chats: list[list[dict[str, str]]]) -> TensorDict:
    """Tokenize full chats with the chat template; loss only on the assistant's tokens.

    The assistant tokens come from the template's `{% generation %}` marks or, without them, from renders
    of the chat's prefixes (`assistant_token_mask`). Carries zero `advantages` so it goes through the same
    learner step as RL batches.
    """
    parts = []
    for chat in chats:
        enc = assistant_token_mask(tokenizer, chat)
        ids, amask = enc["input_ids"].tolist(), enc["assistant_masks"].tolist()
        if not any(amask):
            raise ValueError(f"SFT chat has no assistant tokens (no assistant message?): {chat!r:.200}")
        parts.append(make_trajectory(ids, [0.0] * len(ids), amask, [-1] * len(ids), reward=0.0))
    batch = concat_padded(parts)
    batch["advantages"] = torch.zeros(batch.batch_size[0])
    return batch
