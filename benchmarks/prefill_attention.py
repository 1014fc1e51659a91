"""Compiled causal prefill attention against torch's bf16 SDPA on the same prompts (issue 27).

SmolLM2's heads (9 query heads over 3 key heads of 64, bfloat16, the q / k / v heads strided out of
one qkv tensor as SelfAttention hands them over) for --prompts prompts of seeded lengths in
--lengths (the mixed workload's 44 first-step prompts of 16..384 tokens by default). Each pass runs
every prompt once; best pass of --repeats. GFLOP/s counts the causal q.k and p.v products
(4 x visible pairs x heads x head_dim).

    python benchmarks/prefill_attention.py [--prompts 44] [--lengths 16 384] [--threads 2]
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from gemv_stream import best_seconds  # this folder's: the script's own directory is on sys.path

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's causal SDPA in bfloat16 on [L, heads, D] rows (what runs where the kernel does not)."""
    o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=44)
    parser.add_argument("--lengths", type=int, nargs=2, default=[16, 384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from bestiary.core.kernels.cpu import ops
    from bestiary.core.kernels.cpu.build import chosen_isa

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    lengths = [rng.randint(*args.lengths) for _ in range(args.prompts)]
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(n, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for n in lengths]
    rows = [(t[:, :HEADS], t[:, HEADS : HEADS + KV_HEADS], t[:, HEADS + KV_HEADS :]) for t in qkv]
    scale = HEAD_DIM**-0.5
    if not ops.prefill_attention_fits(*rows[0]):
        raise SystemExit(f"kernels {chosen_isa()}: the compiled prefill attention runs on the avx512bf16 build only")
    flops = sum(4 * n * (n + 1) / 2 * HEADS * HEAD_DIM for n in lengths)
    kernel = best_seconds(lambda: [ops.prefill_attention(q, k, v, scale) for q, k, v in rows], args.repeats)
    torch_side = best_seconds(lambda: [sdpa(q, k, v, scale) for q, k, v in rows], args.repeats)
    print(f"kernels {chosen_isa()}, {args.threads} threads, {args.prompts} prompts of {args.lengths[0]}.."
          f"{args.lengths[1]} tokens ({sum(lengths)} in all)")
    for name, seconds in (("compiled", kernel), ("torch SDPA bf16", torch_side)):
        print(f"{name:16s} {seconds * 1e3:7.1f} ms a layer  {flops / seconds / 1e9:6.1f} GFLOP/s")
    print(f"SDPA / compiled: {torch_side / kernel:.2f}x")


if __name__ == "__main__":
    main()
