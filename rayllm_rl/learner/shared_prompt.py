"""Training forward with each prompt run once per group: the G rows of a GRPO group repeat one prompt.

A packed row holds a prompt once, followed by the rest of every row that starts with it (its completion and
any later turns). A 4D attention mask lets each rest attend to the prompt and to itself only, and each rest's
position ids continue from the prompt's end, as in its own row. So every logprob is the one the padded forward
computes (the same function; float rounding differs with the matmul shapes), while the decoder runs the prompt's
tokens once instead of G times: with SmolLM2's chat template a prompt is ~2/3 of a row, and a step's forward and
backward cost ~2.4x less at G = 8.

A row's prompt is its tokens before its first scored token (`positions`, the loss mask in training); rows
with the same prompt tokens share it, whatever their group. A packed row is at most `max_tokens` long (a group
that does not fit is split, each part repeating the prompt), and packed rows form micro-batches by the same
token budget as padded rows (`token_budget_micro_batches`). The mask is dense (`[P, 1, L, L]`), so this path
needs attention that takes a 4D mask (sdpa, eager) and no sliding window (`supports_shared_prompt`); with
flash-attention and long rows the padded path is the better one (`optim.share_prompts=false`).
"""
from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from rayllm_rl.learner.logprobs import _head_forward, chunked_head_logprobs, linear_head, token_budget_micro_batches
from rayllm_rl.sampling_mask import SamplingMask

MASKS = ("sdpa", "eager")
"""Attention implementations that read a 4D mask as given: sdpa a boolean one, eager an additive float one."""


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Whether `model` computes the same logprobs packed: a Linear output head (the chunked path), attention
    that takes a 4D mask as is, and no sliding-window layer (a 4D mask would replace its window)."""
    cfg = getattr(model, "config", None)
    if cfg is None or linear_head(model) is None or getattr(cfg, "_attn_implementation", None) not in MASKS:
        return False
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(cfg, "sliding_window", None) is None or getattr(cfg, "use_sliding_window", True) is False


@dataclasses.dataclass
class PackedRows:
    """One micro-batch of packed rows: `rows` `[R]` of the batch it scores, laid out as `input_ids` `[P, L]`.

    `segment` `[P, L]`: 0 the shared prompt, k > 0 the k-th rest of the packed row, -1 padding. `src` `[M]`
    flat index into `[P * L]` of the hidden state that predicts each scored token, `dst` `[M]` flat index into
    `[R, width]` of that token, `targets` `[M]` the token ids."""

    rows: torch.Tensor
    width: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    targets: torch.Tensor

    def attention_mask(self, implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """`[P, 1, L, L]`: query q sees key k <= q in the prompt or in q's own rest; a padding query sees itself
        (a row of -inf would make softmax NaN). Boolean for sdpa, additive `dtype` (0 / min) for eager."""
        seg = self.segment
        q, k = seg[:, :, None], seg[:, None, :]
        n = seg.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal & (k >= 0) & ((k == 0) | (k == q)) | torch.eye(n, dtype=torch.bool)
        allowed = allowed[:, None]
        if implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)


def _prompt_lengths(positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens before its first scored one (column 0 is never scored: nothing predicts it);
    a row with no scored token is all prompt."""
    scored = positions.clone()
    scored[:, 0] = False
    return torch.where(scored.any(-1), scored.int().argmax(-1), lengths)


def packed_micro_batches(td: TensorDict, max_tokens: int, max_rows: int = 0,
                         positions: torch.Tensor | None = None) -> list[PackedRows]:
    """`PackedRows` per micro-batch of right-padded `td`, scoring `positions` `[N, T]` (default
    the loss mask). Each packed row is at most `max_tokens` long unless one row alone is longer; micro-batches
    hold packed rows with rows x longest <= `max_tokens` (and at most `max_rows` packed rows if > 0)."""
    ids, lengths = td["input_ids"], td["attention_mask"].sum(-1)
    pos = (td["loss_mask"] if positions is None else positions).to(torch.bool)
    pos = pos & td["attention_mask"].to(torch.bool)
    prompt_len = _prompt_lengths(pos, lengths)
    groups: dict[bytes, list[int]] = {}
    for i in range(ids.shape[0]):
        groups.setdefault(ids[i, :int(prompt_len[i])].numpy().tobytes(), []).append(i)
    packs: list[list[int]] = []  # each: rows sharing one prompt, prompt + their rests within max_tokens
    for members in groups.values():
        p = int(prompt_len[members[0]])
        cur, size = [], p
        for i in members:
            rest = int(lengths[i]) - p
            if cur and size + rest > max_tokens:
                packs.append(cur)
                cur, size = [], p
            cur.append(i)
            size += rest
        packs.append(cur)
    pack_len = torch.tensor([int(prompt_len[m[0]]) + sum(int(lengths[i] - prompt_len[i]) for i in m) for m in packs])
    out = []
    for chosen in token_budget_micro_batches(pack_len, max_tokens, max_rows):
        members = [packs[j] for j in chosen.tolist()]
        rows = torch.tensor([i for m in members for i in m], dtype=torch.long)
        out.append(_pack(rows, ids, lengths, prompt_len, pos, members, int(pack_len[chosen].max())))
    return out


def _pack(rows, ids, lengths, prompt_len, pos, members: list[list[int]], width_packed: int) -> PackedRows:
    """Lay out packed rows `members` (lists of batch rows sharing a prompt; `rows` all of them in order) in
    `[P, width_packed]`."""
    n_packs = len(members)
    width = int(max(int(lengths[i]) for m in members for i in m))
    input_ids = torch.zeros(n_packs, width_packed, dtype=ids.dtype)
    position_ids = torch.zeros(n_packs, width_packed, dtype=torch.long)
    segment = torch.full((n_packs, width_packed), -1, dtype=torch.long)
    src, dst, targets = [], [], []
    r = 0  # the local row index within this micro-batch
    for pk, m in enumerate(members):
        p = int(prompt_len[m[0]])
        input_ids[pk, :p] = ids[m[0], :p]
        position_ids[pk, :p] = torch.arange(p)
        segment[pk, :p] = 0
        at = p  # where the next rest starts in the packed row
        for k, i in enumerate(m, start=1):
            n = int(lengths[i])
            input_ids[pk, at:at + n - p] = ids[i, p:n]
            position_ids[pk, at:at + n - p] = torch.arange(p, n)
            segment[pk, at:at + n - p] = k
            t = pos[i, 1:n].nonzero().squeeze(1) + 1  # scored tokens of row i (column >= 1)
            before = t - 1  # the row position whose hidden state predicts token t
            loc = torch.where(before < p, before, at + (before - p))  # in the prompt, or in this row's rest
            src.append(pk * width_packed + loc)
            dst.append(r * width + t)
            targets.append(ids[i, t])
            at += n - p
            r += 1
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return PackedRows(rows, width, input_ids, position_ids, segment, cat(src), cat(dst), cat(targets))


def packed_token_logprobs(model: torch.nn.Module, packed: PackedRows, temperature: float = 1.0, *,
                          device: torch.device | str = "cpu", chunk_size: int = 512, with_entropy: bool = False,
                          mask: SamplingMask = SamplingMask()):
    """Token-aligned logprobs `[R, width]` of the packed micro-batch's rows (0 where not scored), and with
    `with_entropy` the detached entropy at the same places: what `token_logprobs` gives on the padded rows."""
    head = linear_head(model)
    impl = model.config._attn_implementation
    dtype = next(model.parameters()).dtype
    if torch.is_autocast_enabled(torch.device(device).type):
        dtype = torch.get_autocast_dtype(torch.device(device).type)
    src, dst, targets = packed.src.to(device), packed.dst.to(device), packed.targets.to(device)
    side: dict[str, torch.Tensor | None] = {}

    def head_logprobs(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])[src]
        logp, ent = chunked_head_logprobs(flat, head, targets, temperature, chunk_size, with_entropy, mask)
        size = packed.rows.numel() * packed.width
        side["entropy"] = (hidden.new_zeros(size, dtype=ent.dtype).index_put((dst,), ent).view(-1, packed.width)
                           if with_entropy else None)
        return hidden.new_zeros(size, dtype=logp.dtype).index_put((dst,), logp).view(-1, packed.width)

    extra = {"use_cache": False} if hasattr(model.config, "use_cache") else {}
    with _head_forward(head, head_logprobs):
        logp = model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                     attention_mask=packed.attention_mask(impl, dtype).to(device), **extra).logits
    return (logp, side["entropy"]) if with_entropy else logp


@torch.no_grad()
def shared_prompt_logprobs(model: torch.nn.Module, td: TensorDict, max_tokens: int, temperature: float = 1.0,
                           device: torch.device | str = "cpu", *, chunk_size: int = 512, max_rows: int = 0,
                           mask: SamplingMask = SamplingMask()) -> torch.Tensor:
    """A frozen model's logprobs `[N, T]` of `td`'s loss-mask tokens (0 elsewhere), each prompt run once per
    group: what `batched_token_logprobs` gives there, for ~G x less prompt compute (a teacher scoring a batch)."""
    n, t = td["input_ids"].shape
    out: torch.Tensor | None = None
    for packed in packed_micro_batches(td, max_tokens, max_rows):
        lp = packed_token_logprobs(model, packed, temperature, device=device, chunk_size=chunk_size, mask=mask).cpu()
        if out is None:
            out = torch.zeros(n, t, dtype=lp.dtype)
        out[packed.rows, :lp.shape[1]] = lp
    return out if out is not None else torch.zeros(n, t)


@torch.no_grad()
def check_shared_prompt(model: torch.nn.Module, chunk_size: int = 512) -> None:
    """Raise ValueError unless packed rows give the padded rows' logprobs on a short input (two rows that share
    a prompt): catches a model whose attention does not honour a 4D mask as given. Eval mode, one forward each."""
    from rayllm_rl.learner.logprobs import token_logprobs

    device = next(model.parameters()).device
    vocab = int(linear_head(model).weight.shape[0])
    ids = (torch.arange(14) * 7919 + 11).remainder(vocab).view(2, 7)
    ids[1, :4] = ids[0, :4]  # a 4-token prompt, then rests of 3 and 2 tokens: one packed row of 9
    am = torch.ones_like(ids)
    am[1, 6] = 0
    lm = am.clone()
    lm[:, :4] = 0
    td = TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": lm}, batch_size=[2])
    was_training = model.training
    model.eval()
    try:
        want = token_logprobs(model, ids.to(device), am.to(device), positions=(lm != 0).to(device),
                              chunk_size=chunk_size).cpu()
        packed, = packed_micro_batches(td, 64)
        got = torch.zeros_like(want)
        got[packed.rows] = packed_token_logprobs(model, packed, device=device, chunk_size=chunk_size).cpu()
    finally:
        model.train(was_training)
    diff = float((want - got).abs().max())
    tol = 1e-4 if linear_head(model).weight.dtype in (torch.float32, torch.float64) else 5e-2  # rounding, not a mask
    if packed.input_ids.shape != (1, 9) or not diff <= tol * max(1.0, float(want.abs().max())):
        raise ValueError(f"{type(model).__name__}: rows packed behind a shared prompt score differently from the "
                         f"padded rows (max |diff| {diff:.3g}); its attention does not take a 4D mask as given: set "
                         "optim.share_prompts=false")
