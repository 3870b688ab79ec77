"""LoRA policies (`model.lora.*`): the learner trains the adapter only, only the adapter is synced, the
engines apply it with per-token versions, the reference is the base model with the adapter off,
checkpoints are PEFT adapters and the export merges them into a full HF model.

Every model here is the offline tiny Qwen2 (`tiny_model_path`), loaded with from_pretrained.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
import torch

from rayllm_rl.learner.learner import Learner, OptimConfig
from rayllm_rl.lora import LoraOptions, adapter_parameters, peft_name
from rayllm_rl.objectives import GRPOLoss
from test_engine_contract import LoopThread  # one event loop thread, as a replica actor drives its engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LORA = LoraOptions(rank=8, alpha=16.0)


def rl_batch(path: str, rows: int = 6, seed: int = 0):
    """A GRPO batch of chats (tokenised with the chat template), random advantages, behaviour logprobs of
    the untrained model (the adapter starts as the base model)."""
    from transformers import AutoTokenizer

    from rayllm_rl.data.sft import make_sft_batch

    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    chats = [[{"role": "user", "content": f"What is {i}+{i + 3}?"},
              {"role": "assistant", "content": f"<answer>{2 * i + 3}</answer>" + " ok" * (i % 3)}] for i in range(rows)]
    batch = make_sft_batch(tok, chats)
    batch["advantages"] = torch.randn(rows, generator=g)
    batch["logprobs"] = Learner(path, OptimConfig()).compute_logprobs(batch)
    return batch


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    return rl_batch(tiny_model_path)


def trained_learner(path, batch, steps: int = 2, lr: float = 5e-3, lora: LoraOptions = LORA) -> Learner:
    learner = Learner(path, OptimConfig(lr=lr), lora=lora)
    for _ in range(steps):
        learner.train_step(batch, GRPOLoss())
    return learner


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for t in named.values())


# ---------------------------------------------------------------------------- config
def test_config_defaults_unchanged_and_lora_presets():
    from rayllm_rl.job.config import GRPOJobConfig
    from rayllm_rl.job.plan import make_plan

    base = GRPOJobConfig().validate(environment=False)
    assert base.model.lora.rank == 0 and base.optim.lr == 5e-5 and base.sft.lr == 1e-3 and base.sft.steps == 250
    lora = GRPOJobConfig()
    lora.model.lora.rank = 8
    lora = lora.validate(environment=False)
    assert (lora.optim.lr, lora.sft.lr, lora.sft.steps) == (5e-4, 1e-3, 0)
    mine = GRPOJobConfig()
    mine.model.lora.rank, mine.optim.lr, mine.task = 8, 2e-4, "gsm8k"
    mine = mine.validate(environment=False)
    assert mine.optim.lr == 2e-4 and mine.sft.lr == 1e-4  # the user's value wins; gsm8k's LoRA preset
    kl = GRPOJobConfig()
    kl.algo.kl_coef = 0.1
    assert make_plan(kl.validate(environment=False)).frozen_names() == ("reference",)
    kl.model.lora.rank = 8
    assert make_plan(kl.validate(environment=False)).frozen == ()  # the learner's adapter-off model serves it


@pytest.mark.parametrize("overrides, match", [
    (["model.lora.rank=-1"], "model.lora.rank=-1"),
    (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha"),
    (["model.lora.rank=8", "model.lora.dropout=1.0"], "model.lora.dropout"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules"),
    (["model.lora.rank=8", "algo.kl_reward_coef=0.1"], "algo.kl_reward_coef"),
    (["model.lora.rank=8", "inference.engine=vllm", "inference.options={max_lora_rank: 4}"], "max_lora_rank=4"),
    (["model.lora.rank=16", "inference.engine=vllm", "inference.options={max_lora_rank: 8}"], "max_lora_rank=8 < "),
    (["inference.engine=vllm", "inference.options={max_lora_rank: 8}"], "only with model.lora.rank > 0"),
])
def test_config_checks_name_the_key(overrides, match):
    from rayllm_rl.config import apply_dict, parse_overrides
    from rayllm_rl.job.config import GRPOJobConfig

    cfg = apply_dict(GRPOJobConfig(), parse_overrides(overrides))
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        cfg.validate(environment=False)


def test_config_target_modules_from_the_command_line():
    from rayllm_rl.config import apply_dict, parse_overrides
    from rayllm_rl.inference.vllm.lora import max_lora_rank
    from rayllm_rl.job.config import GRPOJobConfig

    cfg = apply_dict(GRPOJobConfig(), parse_overrides(["model.lora.rank=4",
                                                       "model.lora.target_modules=[q_proj,v_proj]"]))
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert [max_lora_rank(r) for r in (1, 4, 8, 9, 64)] == [1, 8, 8, 16, 64]


# ---------------------------------------------------------------------------- learner
def test_learner_trains_and_syncs_only_the_adapter(tiny_model_path, batch):
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    learner = Learner(tiny_model_path, OptimConfig(lr=5e-3), lora=LORA)
    trained = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    in_optim = sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"])
    adapter = learner.named_tensors()
    assert in_optim == sum(t.numel() for t in adapter.values())
    # 3 layers x 7 projections x (A, B): 42 tensors, PEFT names, and ~10% of the tiny model's bytes
    assert len(adapter) == 42 and all(n.startswith("base_model.model.model.layers.") for n in adapter)
    assert [m.name for m in learner.weight_metas()] == list(adapter)
    assert nbytes(adapter) == 58368 * 4 and nbytes(adapter) < 0.2 * nbytes(base)
    b0 = {n: t.clone() for n, t in adapter.items() if ".lora_B." in n}
    assert all(float(t.abs().max()) == 0.0 for t in b0.values())  # peft's init: B = 0, the base model's output
    for _ in range(2):
        learner.train_step(batch, GRPOLoss())
    after = learner.named_tensors()
    assert max(float(after[n].abs().max()) for n in b0) > 1e-4  # the adapter moved
    frozen = {n.replace(".base_layer", ""): p for n, p in learner.model.named_parameters() if ".lora_" not in n}
    assert set(frozen) == set(base)
    assert max(float((frozen[n] - base[n]).detach().abs().max()) for n in base) == 0.0  # the base did not


def test_reference_is_the_base_model_with_the_adapter_off(tiny_model_path, batch):
    from rayllm_rl.learner.frozen import FrozenModel

    learner = trained_learner(tiny_model_path, batch)
    ref = learner.reference_logprobs(batch)
    base = FrozenModel(tiny_model_path).compute_logprobs(batch)
    mask = batch["loss_mask"].bool()
    assert float((ref - base)[mask].abs().max()) <= 1e-5
    policy = learner.compute_logprobs(batch)
    assert float((policy - base)[mask].abs().max()) > 1e-3  # the adapter is on everywhere else
    assert all(p.requires_grad for p in adapter_parameters(learner.model).values())  # adapter_off left them
    # a KL loss without ref_logprobs in the batch: the learner computes them itself (same numbers)
    out = learner.train_step(batch, GRPOLoss(kl_coef=0.1))
    assert out["kl_ref"] > 0 and "skipped_nonfinite_steps" in out
    with pytest.raises(RuntimeError, match="no LoRA adapter"):
        Learner(tiny_model_path, OptimConfig()).reference_logprobs(batch)


def test_checkpoint_is_a_peft_adapter_and_resumes(tiny_model_path, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rayllm_rl.learner.checkpoint import load_checkpoint, save_checkpoint

    learner = trained_learner(tiny_model_path, batch)
    save_checkpoint(learner, tmp_path / "ck", extra={"step": 2})
    files = set(os.listdir(tmp_path / "ck"))
    assert {"adapter_model.safetensors", "adapter_config.json", "learner_state.pt"} <= files
    assert not any(f.startswith("model") for f in files)  # no full weights
    cfg = json.loads((tmp_path / "ck" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (8, 16.0, tiny_model_path)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(tmp_path / "ck"))
    ids, am = batch["input_ids"], batch["attention_mask"].long()
    with torch.no_grad():
        ours = learner.model.eval()(input_ids=ids, attention_mask=am).logits
        theirs = peft.eval()(input_ids=ids, attention_mask=am).logits
    assert float((ours - theirs).abs().max()) <= 1e-5
    learner.model.train()

    resumed = Learner(tiny_model_path, OptimConfig(lr=5e-3), lora=LORA, seed=7)
    assert load_checkpoint(resumed, tmp_path / "ck") == {"step": 2}
    a, b = learner.named_tensors(), resumed.named_tensors()
    assert max(float((a[n] - b[n]).abs().max()) for n in a) == 0.0 and resumed.optim_steps == learner.optim_steps
    learner.train_step(batch, GRPOLoss())
    resumed.train_step(batch, GRPOLoss())  # same optimizer state: the same next step
    a, b = learner.named_tensors(), resumed.named_tensors()
    assert max(float((a[n] - b[n]).abs().max()) for n in a) <= 1e-7

    with pytest.raises(ValueError, match="model.lora.rank=8"):
        load_checkpoint(Learner(tiny_model_path, OptimConfig()), tmp_path / "ck")
    with pytest.raises(ValueError, match="rank 8"):
        load_checkpoint(Learner(tiny_model_path, OptimConfig(), lora=LoraOptions(rank=4)), tmp_path / "ck")


def test_export_merges_into_a_full_model(tiny_model_path, batch, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rayllm_rl.export_lora import main
    from rayllm_rl.learner.checkpoint import save_checkpoint

    learner = trained_learner(tiny_model_path, batch)
    save_checkpoint(learner, tmp_path / "ck")
    assert main([str(tmp_path / "ck"), str(tmp_path / "full")]) == 0  # `python -m rayllm_rl.export_lora ck full`
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(tmp_path / "ck")).eval()
    ids, am = batch["input_ids"], batch["attention_mask"].long()
    with torch.no_grad():
        diff = float((merged(input_ids=ids, attention_mask=am).logits
                      - peft(input_ids=ids, attention_mask=am).logits).abs().max())
    assert diff <= 1e-4
    assert not any("lora" in n for n, _ in merged.named_parameters())
    capsys.readouterr()
    assert main([str(tmp_path), str(tmp_path / "x")]) == 2
    assert "not a PEFT LoRA adapter" in capsys.readouterr().err


# ---------------------------------------------------------------------------- sync and engines
def sync_adapter(loop, engine, learner: Learner, version: int, transport: str = "gloo"):
    """Learner → engine over a real transport (this process is learner rank 0): returns (engine result, stats)."""
    from rayllm_rl.weight_sync import metas_to_spec
    from rayllm_rl.weight_sync.registry import make_spec
    from weight_sync_helpers import OpenedInBackground

    metas = learner.weight_metas()
    spec = make_spec(transport, metas_to_spec(metas), receivers=engine.weights.receiving_processes(transport),
                     timeout_s=60.0, bucket_bytes=1 << 16, host="127.0.0.1")
    rank0 = OpenedInBackground(spec, metas)  # a group binds its store here, finishes while the engine joins
    loop.run(engine.weights.init_update_group(rank0.spec.for_rank(1)))
    box: dict = {"sender": rank0.sender(60)}
    send = threading.Thread(target=lambda: box.setdefault("sent", box["sender"].send(learner.iter_named_tensors(),
                                                                                      version)))
    send.start()
    result = loop.run(engine.weights.receive_weights())
    send.join(60)
    loop.run(engine.weights.close_update_group())
    box["sender"].close()
    return result, box["sent"][0]


def generate(loop, engine, prompts, sampling):
    from rayllm_rl.inference.protocol import LLMRequest

    async def go():
        return await asyncio.gather(*[engine.agenerate(LLMRequest(input_ids=p, sampling=sampling)) for p in prompts])

    return loop.run(go())


def learner_logprobs(learner: Learner, responses) -> list[torch.Tensor]:
    """The learner's (peft forward) logprobs of each response's output tokens."""
    from rayllm_rl.data.trajectory import concat_padded, make_trajectory

    parts = [make_trajectory(r.input_tokens + r.output_tokens, [0.0] * (r.input_len + r.output_len),
                             [0] * r.input_len + [1] * r.output_len, [-1] * (r.input_len + r.output_len), reward=0.0)
             for r in responses]
    td = concat_padded(parts)
    lp = learner.compute_logprobs(td)
    return [lp[i][td["loss_mask"][i].bool()] for i in range(len(responses))]


def check_engine_follows_learner(kind, engine, loop, tiny_model_path, batch, tokenizer):
    """Two syncs: bytes on the wire are the adapter's; every token carries the adapter's version; the
    engine's logprobs equal the learner's peft forward; a request in flight over an update is re-prefilled."""
    from rayllm_rl.inference.protocol import SamplingParams, weights_checksum

    learner = trained_learner(tiny_model_path, batch, steps=1)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i}+2?"}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
               for i in range(4)]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    for version in (1, 2):
        result, stats = sync_adapter(loop, engine, learner, version)
        adapter_bytes = nbytes(learner.named_tensors())
        assert stats.bytes == adapter_bytes == 58368 * 4  # the adapter, nothing else
        assert result["version"] == version == engine.version
        assert abs(loop.run(engine.weights.weights_checksum()) - weights_checksum(learner.named_tensors())) <= 1e-6 * \
            abs(weights_checksum(learner.named_tensors()))
        out = generate(loop, engine, prompts, sp)
        assert all(r.output_versions == [version] * 8 for r in out)
        ours = learner_logprobs(learner, out)
        diff = max(float((torch.tensor(r.output_logprobs) - o).abs().max()) for r, o in zip(out, ours))
        assert diff <= 2e-4, f"{kind}: engine logprobs differ from the learner's peft forward by {diff}"
        learner.train_step(batch, GRPOLoss())

    # the base model is not what the engine serves: its logprobs differ from the adapter's
    with_adapter = learner_logprobs(learner, out)
    from rayllm_rl.lora import adapter_off

    with adapter_off(learner.model):
        base = learner_logprobs(learner, out)
    assert max(float((a - b).abs().max()) for a, b in zip(with_adapter, base)) > 1e-3


def test_transformers_engine_serves_the_synced_adapter(tiny_model_path, batch, tokenizer):
    from rayllm_rl.inference.transformers.engine import TransformersEngine

    loop = LoopThread()
    engine = TransformersEngine(tiny_model_path, seed=0, device="cpu", lora=LORA)
    try:
        assert [m[0] for m in engine.weights.weight_metadata()] == [
            peft_name(n) for n, p in engine.model.named_parameters() if ".lora_" in n]
        check_engine_follows_learner("transformers", engine, loop, tiny_model_path, batch, tokenizer)
        assert engine.stats.cache_rebuilds >= 0
    finally:
        loop.run(engine.aclose())
        loop.close()


def test_transformers_engine_reprefills_a_request_in_flight(tiny_model_path, batch, tokenizer):
    """A request decoding while a new adapter is swapped in: tokens before the swap carry v1, after it v2,
    and the later ones are the learner's greedy chain under adapter v2 from that prefix (KV rebuilt)."""
    import time

    from rayllm_rl.inference.protocol import LLMRequest, SamplingParams
    from rayllm_rl.inference.transformers.engine import TransformersEngine

    learner = trained_learner(tiny_model_path, batch, steps=1)
    engine = TransformersEngine(tiny_model_path, seed=0, device="cpu", lora=LORA)
    engine.weights.load_weights_sync(learner.named_tensors(), version=1)
    learner.train_step(batch, GRPOLoss())
    new = {k: v.clone() for k, v in learner.named_tensors().items()}
    p = list(tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    calls, swapper, forward = 0, [], engine.model.forward

    def hooked(*a, **k):  # at the 4th decode step, a writer swaps v2 in; it lands before the 5th
        nonlocal calls
        calls += 1
        if calls == 4:
            swapper.append(threading.Thread(target=engine.weights.swap_weights, args=(new, 2)))
            swapper[0].start()
            time.sleep(0.3)  # the writer holds the gate and waits for this step to end
        return forward(*a, **k)

    engine.model.forward = hooked
    (out,) = engine.generate([LLMRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=10, greedy=True,
                                                                              ignore_eos=True))])
    swapper[0].join(30)
    assert out.output_versions == [1] * 4 + [2] * 6 and engine.stats.cache_rebuilds == 1
    learner.model.eval()
    with torch.no_grad():
        logits = learner.model(input_ids=torch.tensor([p + out.output_tokens])).logits[0]
    learner.model.train()
    assert logits[len(p) + 3:-1].argmax(-1).tolist() == out.output_tokens[4:]


@pytest.mark.slow
def test_fsdp_two_ranks_train_the_same_adapter(tiny_model_path, batch, tmp_path):
    """W=2 over gloo (FSDP2 with frozen base weights in the same groups): the adapter equals W=1's after two
    steps, the reference (adapter off) is the base model, and a W=2 checkpoint is the same PEFT adapter."""
    from rayllm_rl.learner.distributed import launch_local
    from rayllm_rl.learner.frozen import FrozenModel

    res = launch_local(_fsdp_rank, 2, tiny_model_path, batch, str(tmp_path / "ck2"), timeout_s=240)
    single = trained_learner(tiny_model_path, batch, steps=2, lr=1e-3)
    want = single.named_tensors()
    for rank in (0, 1):
        got = res[rank]["adapter"]
        assert list(got) == list(want)
        assert max(float((got[n] - want[n]).abs().max()) for n in want) <= 1e-5
    mask = batch["loss_mask"].bool()
    base = FrozenModel(tiny_model_path).compute_logprobs(batch)
    assert float((res[0]["ref"] - base)[mask].abs().max()) <= 1e-5
    from rayllm_rl.lora import read_adapter

    saved = read_adapter(tmp_path / "ck2")
    assert max(float((saved[n] - want[n]).abs().max()) for n in want) <= 1e-5


def _fsdp_rank(dist_cfg, queue, path: str, batch, ckpt: str) -> None:
    torch.set_num_threads(1)
    from rayllm_rl.learner.checkpoint import save_checkpoint
    from rayllm_rl.learner.distributed import destroy_distributed

    learner = Learner(path, OptimConfig(lr=1e-3), lora=LORA, dist=dist_cfg)
    for _ in range(2):
        learner.train_step(batch, GRPOLoss())
    ref = learner.reference_logprobs(batch)
    adapter = learner.named_tensors()
    save_checkpoint(learner, ckpt)
    destroy_distributed()
    queue.put((dist_cfg.rank, {"adapter": adapter, "ref": ref}))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_serves_the_synced_adapter(tiny_model_path, batch, tokenizer):
    """vLLM's CPU build with enable_lora: the adapter arrives over gloo in the replica (this engine), is
    written in PEFT format and loaded in place; logprobs equal the learner's peft forward, versions stamped."""
    from rayllm_rl.inference.vllm.engine import VLLMEngine, VLLMOptions
    from rayllm_rl.inference.protocol import SamplingParams

    loop = LoopThread()
    engine = VLLMEngine(tiny_model_path, seed=0, options=VLLMOptions(kv_cache_mb=128), lora=LORA)
    try:
        loop.run(engine.start())
        assert engine.weights.receiving_processes("gloo") == 1
        # before any update: the all-zero adapter, i.e. the base model, at version 0
        p = list(tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+2?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
        (r0,) = generate(loop, engine, [p], SamplingParams(max_new_tokens=6, ignore_eos=True))
        base = Learner(tiny_model_path, OptimConfig())
        assert r0.output_versions == [0] * 6
        assert float((torch.tensor(r0.output_logprobs) - learner_logprobs(base, [r0])[0]).abs().max()) <= 2e-4
        check_engine_follows_learner("vllm", engine, loop, tiny_model_path, batch, tokenizer)
        assert len(os.listdir(engine.weights.adapters.root)) <= 2  # old version directories are deleted
    finally:
        loop.run(engine.aclose())
        loop.close()
