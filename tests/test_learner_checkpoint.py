"""Learner checkpoints resume exactly: save after 2 steps, reload into a fresh learner, same next steps."""
from __future__ import annotations

import pytest
import torch

from rayllm_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from rayllm_rl.learner.distributed import DistConfig, launch_local
from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.objectives import GRPOLoss

# Two minibatches and two epochs per step: the seeded permutation must resume too; warm-up and a cosine decay
# over the 16 optimizer steps: the step count. Token-budget micro-batches (rows of ~25-30 tokens, two per
# micro-batch) and a chunked LM head.
OPTIM = OptimConfig(lr=1e-3, max_tokens_per_micro_batch=64, logprob_chunk_size=8, num_minibatches=2, epochs=2,
                    warmup_steps=6, weight_decay=0.01, lr_schedule="cosine", decay_steps=16, min_lr_ratio=0.1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")



def make_batches(path: str, n: int = 4, rows: int = 6):
    from transformers import AutoTokenizer

    from rayllm_rl.data.sft import make_sft_batch

    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(7)
    out = []
    for b in range(n):
        chats = [[{"role": "user", "content": f"What is {b}+{i}?"},
                  {"role": "assistant", "content": f"<answer>{b + i}</answer>" + " so" * (i % 3)}] for i in range(rows)]
        batch = make_sft_batch(tok, chats)
        batch["advantages"] = torch.randn(rows, generator=g)
        batch["logprobs"] = -torch.rand(batch["loss_mask"].shape, generator=g) * batch["loss_mask"]
        out.append(batch)
    return out


def train(learner: Learner, batches) -> None:
    for b in batches:
        learner.train_step(b, GRPOLoss())


def resume_run(path: str, ckpt: str, batches, dist: DistConfig | None = None) -> dict:
    """Train 2, save, train 2 (reference); then a fresh learner loads the checkpoint and trains the same 2."""
    first = Learner(path, OPTIM, dist=dist)
    train(first, batches[:2])
    torch.manual_seed(999)  # the global RNG state at save time must come back too
    save_checkpoint(first, ckpt, extra={"loader": {"epoch": 3, "index": 17}, "policy_version": 2})
    rng_at_save = torch.get_rng_state()
    train(first, batches[2:])
    want = first.named_tensors()

    second = Learner(path, OPTIM, dist=dist, seed=123)  # different seed: everything must come from the checkpoint
    extra = load_checkpoint(second, ckpt)
    rng_restored = torch.equal(torch.get_rng_state(), rng_at_save)
    counters = second.optim_steps
    train(second, batches[2:])
    got = second.named_tensors()
    return {"want": want, "got": got, "extra": extra, "rng_restored": rng_restored, "counters_after_load": counters,
            "steps": (first.optim_steps, second.optim_steps)}


def check_resume(res: dict) -> float:
    want, got = res["want"], res["got"]
    assert list(want) == list(got)
    diff = max(float((want[k] - got[k]).abs().max()) for k in want)
    assert diff <= 1e-7, diff
    assert res["extra"] == {"loader": {"epoch": 3, "index": 17}, "policy_version": 2}
    assert res["rng_restored"]
    assert res["counters_after_load"] == 8  # 2 steps x 2 epochs x 2 minibatches
    assert res["steps"] == (16, 16)
    return diff


def test_single_process_resume_is_exact(tiny_model_path, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    batches = make_batches(tiny_model_path)
    res = resume_run(tiny_model_path, str(tmp_path / "ckpt"), batches)
    assert check_resume(res) == 0.0

    # The checkpoint is an HF model directory holding the weights of the save-time learner.
    again = Learner(tiny_model_path, OPTIM)
    train(again, batches[:2])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    for k, v in again.named_tensors().items():
        assert torch.equal(dict(hf.named_parameters())[k], v), k
    assert hf.lm_head.weight is hf.model.embed_tokens.weight


def test_save_pretrained_writes_tokenizer_and_state(tiny_model_path, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    learner = Learner(tiny_model_path, OptimConfig())
    out = learner.save_pretrained(tmp_path / "m", tokenizer)
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    state = torch.load(tmp_path / "m" / "learner_state.pt", weights_only=False)
    assert state["optim_steps"] == 0 and state["world_size"] == 1 and "version" not in state  # the driver owns it


def _rank_main(dist_cfg: DistConfig, queue, path: str, ckpt: str, batches) -> None:
    torch.set_num_threads(1)
    from rayllm_rl.learner.distributed import destroy_distributed

    res = resume_run(path, ckpt, batches, dist_cfg)
    destroy_distributed()
    queue.put((dist_cfg.rank, res))


@pytest.mark.slow
def test_two_rank_fsdp_resume_is_exact(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    batches = make_batches(tiny_model_path)
    ckpt = str(tmp_path / "ckpt")
    res = launch_local(_rank_main, 2, tiny_model_path, ckpt, batches, timeout_s=120)
    for r in (0, 1):
        assert check_resume(res[r]) == 0.0
    for k, v in res[0]["got"].items():
        assert torch.equal(res[1]["got"][k], v), k
    # The FSDP checkpoint (rank 0 wrote the gathered full weights) is a plain HF directory ...
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    assert [k for k, _ in hf.named_parameters()] == list(res[0]["got"])
    assert hf.config.architectures == ["Qwen2ForCausalLM"]  # not the FSDP wrapper class name
    # ... and its optimizer state resumes a single-process learner too (close, not bit-exact: W changes sums).
    single = Learner(tiny_model_path, OPTIM)
    load_checkpoint(single, ckpt)
    assert single.optim_steps == 8
    train(single, batches[2:])
    diff = max(float((v - res[0]["want"][k]).abs().max()) for k, v in single.named_tensors().items())
    assert diff <= 1e-5, diff
