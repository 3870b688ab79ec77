"""Environments: ChatEnv and its transforms (data loading, tokenization, counters, rewards)."""
from rayllm_rl.envs.chat_env import INPUT_MODES, ChatEnv
from rayllm_rl.envs.transforms import (
    DataLoadingPrimer,
    IncrementalTokenizer,
    PolicyVersion,
    RewardTransform,
    StepCounter,
    Transform,
)
from rayllm_rl.data.chat_template import chat_suffix

__all__ = [
    "ChatEnv",
    "INPUT_MODES",
    "Transform",
    "DataLoadingPrimer",
    "IncrementalTokenizer",
    "StepCounter",
    "PolicyVersion",
    "RewardTransform",
    "chat_suffix",
]
