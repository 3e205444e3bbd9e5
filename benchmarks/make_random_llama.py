"""Write a randomly initialised Llama checkpoint of a given shape, for speed and energy measurements.

Random weights are fine for ms/token and J/token (the arithmetic and memory traffic are those of the
real model) and meaningless for quality. The vocabulary is the demo tokenizer's (49,152 tokens, copied
in) so prompts and outputs stay decodable; with Llama-3's 128,256-token vocabulary the 8B shape would
have 0.64 B more embedding and output parameters (8.03 B instead of 7.39 B).

    python benchmarks/make_random_llama.py --shape llama-3.1-8b --out /tmp/llama8b --tokenizer DIR --device cuda
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    # Llama-3.1-8B: 32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads, RoPE theta 500k
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True, help="directory holding the demo tokenizer files")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    started = time.perf_counter()
    config = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=False, **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    out = Path(args.out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        src = Path(args.tokenizer) / name
        if src.is_file():
            shutil.copy(src, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e9:.2f} B parameters written to {out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
