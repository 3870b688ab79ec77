"""LoRA on vLLM replicas: the received adapter becomes a vLLM LoRA adapter, loaded at run time.

vLLM 0.32 loads an adapter only from a directory (`LoRARequest.lora_path` is required; its worker
reads `adapter_config.json` and `adapter_model.safetensors` with `PEFTHelper.from_local_dir` and
`LoRAModel.from_local_checkpoint`). So the replica actor receives the adapter tensors over the job's
transport, whatever it is (adapters are small: the actor takes one rank), and :class:`AdapterDirWriter`,
the receiver's target, writes each version in PEFT format to a directory of its own
(`<tmp>/v<version>/`) while vLLM keeps generating.

Versions: every request carries the one `LoRARequest` of the policy (`lora_int_id` 1, the current
version's directory). A new version is loaded *in place* (`load_inplace=True`: vLLM loads it, drops
the old one and fills the same slot) inside the engine's usual update pause, which keeps running
requests, clears the KV and prefix caches (kept requests are re-prefilled) and stamps the version:
a token stamped v came from adapter v, exactly as with full weights. A new `lora_int_id` per version
would leave requests in flight on the adapter they started with while later tokens are stamped with
the new version. Before the first update the adapter is all zeros (the base model).
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Mapping

import torch

from rayllm_rl.inference.protocol import weights_checksum
from rayllm_rl.lora import LoraOptions, adapter_metas, write_adapter

LORA_NAME = "policy"
LORA_ID = 1
"""The policy's `lora_int_id` (vLLM wants > 0); one adapter slot, reloaded in place every version."""
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`)."""
KEEP_DIRS = 2
"""Version directories kept on disk (the current one, which new requests name, and the one before)."""


def max_lora_rank(rank: int, option: int = 0) -> int:
    """vLLM's `max_lora_rank` for an adapter of `rank`: `option` (inference.options.max_lora_rank) if set,
    else the smallest value vLLM accepts that holds `rank`. Raises naming the key when it cannot."""
    if option:
        if option not in VLLM_RANKS:
            raise ValueError(f"inference.options.max_lora_rank={option}: vLLM accepts {list(VLLM_RANKS)}")
        if option < rank:
            raise ValueError(f"inference.options.max_lora_rank={option} < model.lora.rank={rank}: vLLM refuses an "
                             "adapter of a higher rank; raise it or leave it 0 (the smallest that holds the rank)")
        return option
    fits = [r for r in VLLM_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_RANKS[-1]}")
    return fits[0]


def engine_args(opts: LoraOptions, option_rank: int) -> dict:
    """AsyncEngineArgs of a LoRA policy: one adapter slot of the right rank (dtype: the model's)."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(opts.rank, option_rank), "max_loras": 1,
            "max_cpu_loras": 1}


class AdapterDirWriter:
    """A weight-sync receiver's target (`named_parameters`, `swap_weights`) that writes each received
    adapter as a PEFT directory `<root>/v<version>/`; the vLLM engine then loads it in place."""

    def __init__(self, model_path: str, opts: LoraOptions, dtype: str):
        self.opts, self.model_path = opts, model_path
        self.metas = adapter_metas(model_path, opts, dtype)
        self.root = Path(tempfile.mkdtemp(prefix="rayllm_lora_"))
        self.written: list[tuple[int, str]] = []
        """(version, directory) of every adapter on disk, oldest first."""
        self.checksum: float | None = None
        """`protocol.weights_checksum` of the last adapter written (the learner's of the same version)."""
        self.write_s = 0.0

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """PEFT names, shapes and dtypes an update carries (meta tensors: no memory)."""
        return {n: torch.empty(s, dtype=getattr(torch, d), device="meta") for n, s, d in self.metas}

    def swap_weights(self, named: Mapping[str, torch.Tensor], version: int) -> float:
        """Write `named` as the adapter of `version` (generation goes on: nothing is held); returns 0."""
        t0 = time.perf_counter()
        self.write(named, int(version))
        self.write_s = time.perf_counter() - t0
        return 0.0

    def write(self, named: Mapping[str, torch.Tensor], version: int) -> str:
        known = {n for n, _, _ in self.metas}
        unknown = sorted(set(named) - known)
        if unknown or len(named) != len(known):
            raise KeyError(f"LoRA adapter of version {version}: unknown {unknown[:3]}, missing "
                           f"{sorted(known - set(named))[:3]}")
        cpu = {k: v.detach().to("cpu") for k, v in named.items()}
        directory = write_adapter(self.root / f"v{version}", cpu, self.opts, self.model_path)
        self.checksum = weights_checksum(cpu)
        self.written.append((version, directory))
        return directory

    def zeros(self, version: int) -> str:
        """An all-zero adapter (the base model's output) for the requests before the first update."""
        named = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, s, d in self.metas}
        return self.write(named, version)

    def latest(self) -> tuple[int, str]:
        if not self.written:
            raise RuntimeError("no LoRA adapter was written yet")
        return self.written[-1]

    def prune(self) -> None:
        """Delete all but the newest `KEEP_DIRS` version directories (vLLM holds a loaded adapter in memory)."""
        while len(self.written) > KEEP_DIRS:
            _, directory = self.written.pop(0)
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.written.clear()


def lora_request(directory: str, *, in_place: bool = False):
    """The policy's `LoRARequest` naming `directory`; `in_place` reloads slot `LORA_ID` from it (only in
    `add_lora`: a request carrying it would reload the adapter at every scheduled step)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, LORA_ID, directory, load_inplace=in_place)
