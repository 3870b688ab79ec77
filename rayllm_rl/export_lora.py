"""`python -m rayllm_rl.export_lora <adapter dir> <out dir> [--base <model>] [--dtype float32|bfloat16]`:
merge a LoRA checkpoint (a PEFT adapter: `adapter_model.safetensors` + `adapter_config.json`, what a
`model.lora.rank > 0` job saves under `checkpoints/step_<n>`) into its base model and write a full HF
model that `AutoModelForCausalLM.from_pretrained(out)` (and vLLM) load. The base is the adapter config's
`base_model_name_or_path` unless `--base` names another."""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from rayllm_rl.lora import export_merged

    parser = argparse.ArgumentParser(prog="python -m rayllm_rl.export_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", help="a LoRA checkpoint directory (PEFT adapter)")
    parser.add_argument("out", help="where the merged HF model goes")
    parser.add_argument("--base", default="", help="the base model (default: the adapter config's)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    try:
        print(export_merged(args.adapter, args.out, args.base, getattr(torch, args.dtype)))
    except (FileNotFoundError, ValueError) as exc:
        print(f"export_lora: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
