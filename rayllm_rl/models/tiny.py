"""Build, once and cached on disk, a tiny HF model + tokenizer without any hub access.

The tokenizer is a byte-level BPE trained with `tokenizers` (digits split one per token,
ChatML chat template with `{% generation %}` marks for assistant masks); the model is a
randomly initialised Qwen2 causal LM. Both are written with `save_pretrained`, and every
other module loads them through `from_pretrained(path)` exactly like any hub model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] }}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Size of the tiny Qwen2 model and its tokenizer; the cache key is derived from it."""

    vocab_size: int = 384
    """Target BPE vocabulary (byte alphabet + merges + special tokens)."""
    hidden_size: int = 128
    """Model width."""
    intermediate_size: int = 384
    """MLP width."""
    num_hidden_layers: int = 3
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """KV heads (grouped-query attention, as in real Qwen2 checkpoints)."""
    max_position_embeddings: int = 512
    """Longest sequence the model supports."""
    seed: int = 0
    """Seed of the random initialisation."""

    def key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True) + _corpus_fingerprint()
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """`$RAYLLM_RL_CACHE` or `~/.cache/rayllm_rl`."""
    return Path(os.environ.get("RAYLLM_RL_CACHE", Path.home() / ".cache" / "rayllm_rl"))


def tokenizer_corpus() -> list[str]:
    """Deterministic text the BPE is trained on: chat scaffolding, digits, arithmetic, English."""
    rng = random.Random(1234)
    words = (
        "the a an of to and in is it you that he was for on are as with his they at be this "
        "have from or one had by word but not what all were we when your can said there use "
        "each which she do how their if will up other about out many then them these so some "
        "her would make like him into time has look two more write go see number no way could "
        "people my than first water been call who its now find long down day did get come made "
        "may part answer question solve compute sum add plus minus times what is the result "
        "correct wrong please try again think step assistant user system helpful reason final "
        "python code print def return import tool response error output input value list"
    ).split()
    lines = []
    for _ in range(3000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".")
    for _ in range(3000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a}+{b}? <answer>{a + b}</answer>")
        lines.append(f"{a} - {b} = {a - b}; {a} * {b} = {a * b}. <think>{a}+{b}</think>")
    lines += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"] * 50
    lines += ["```python\nprint(1)\n```", "<tool_response>\n</tool_response>", "#### 42"] * 50
    return lines


def _corpus_fingerprint() -> str:
    return hashlib.sha256("\n".join(tokenizer_corpus()[:50]).encode()).hexdigest()[:8]


def train_tokenizer(vocab_size: int):
    """Train a byte-level BPE (digits split individually) and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
        padding_side="left",
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def build_tiny_model(path: Path, spec: TinyModelSpec) -> None:
    """Write tokenizer + randomly initialised Qwen2 weights to `path` with save_pretrained."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = train_tokenizer(spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_dir: str | Path | None = None) -> str:
    """Return the path of the cached tiny model, building it (atomically) if missing."""
    spec = spec or TinyModelSpec()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"tiny-qwen2-{spec.key()}"
    if (final / "config.json").exists() and (final / "tokenizer.json").exists():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build_tiny_model(tmp, spec)
        try:
            os.rename(tmp, final)  # atomic: a concurrent builder either wins or finds it done
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
