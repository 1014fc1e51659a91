"""GB/s of the compiled decode attention over pools out of cache (issue 27).

SmolLM2's heads (9 query heads over 3 key heads of 64, bf16 pools in blocks of 32 keys, scattered)
for --batch sequences of --keys keys each; every pass runs --layers different pools in turn, so
each call reads its keys and values from memory as a decode step does (the set is larger than
the L3 for 64 x 150 keys). Best pass of --repeats; GB/s = the key and value bytes / seconds.

    python benchmarks/attention_stream.py [--batch 1 4 64] [--keys 150 300 1500] [--layers 8]
"""

from __future__ import annotations

import argparse
import functools

import torch
from gemv_stream import best_seconds  # this folder's: the script's own directory is on sys.path

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32


def pools(batch: int, keys: int, layers: int, gen: torch.Generator) -> list[tuple]:
    """`layers` (k_pool, v_pool, tables): each sequence's blocks scattered over the pool."""
    per_seq = (keys + BLOCK - 1) // BLOCK
    blocks = batch * per_seq + 8
    out = []
    for _ in range(layers):
        k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        out.append((k, v, torch.randperm(blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)))
    return out


def decode_layers(ops, q: torch.Tensor, layers: list[tuple], kv_lens: torch.Tensor) -> None:
    """One decode-attention call per layer's (k, v, block tables) pool."""
    for k, v, tables in layers:
        ops.decode_attention(q, k, v, tables, kv_lens, HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--keys", type=int, nargs="+", default=[150, 300, 1500])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from bestiary.core.kernels.cpu import ops
    from bestiary.core.kernels.cpu.build import chosen_isa

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"kernels {chosen_isa()}, {args.threads} threads")
    for batch in args.batch:
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
        for keys in args.keys:
            layers = pools(batch, keys, args.layers, gen)
            kv_lens = torch.full((batch,), keys)

            step = functools.partial(decode_layers, ops, q, layers, kv_lens)
            seconds = best_seconds(step, args.repeats) / args.layers
            nbytes = 2 * batch * keys * KV_HEADS * HEAD_DIM * 2
            print(f"batch {batch:3d} keys {keys:5d}: {seconds * 1e6:7.0f} us/layer  {nbytes / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
