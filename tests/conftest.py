"""Shared fixtures: the offline tiny model (built once per machine, loaded via from_pretrained)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from rayllm_rl.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture()
def engine(tiny_model_path):
    from rayllm_rl.inference.transformers_engine import TransformersEngine

    return TransformersEngine(tiny_model_path, seed=0)
