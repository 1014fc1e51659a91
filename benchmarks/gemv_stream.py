"""GB/s of the compiled decode GEMV per weight kind, cache-cold and in cache (issue 27).

For each SmolLM2 decode shape (K x N: the fused gate|up 576x3072, down 1536x576, fused qkv 576x960)
and weight kind (bf16 and fp32 in row tiles as the engine holds them, and held transposed as
before them: "bf16 T", "fp32 T"; int8 per channel, int4 group 64), one input row
runs through --layers different weights in turn, so each call finds its weight out of cache (the
set is larger than the L3) as in a decode step; --layers 1 keeps one weight in cache, which
separates a kernel bound by memory from one bound by its instructions. Also times the decode
attention of --batch sequences over --keys keys per layer, pools cache-cold. Best of --repeats;
GB/s = the weight bytes (with scales) / seconds.

    python benchmarks/gemv_stream.py [--layers 30] [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

SHAPES = [(576, 3072), (1536, 576), (576, 960)]


def best_seconds(fn, repeats: int) -> float:
    """Best wall time of fn() over `repeats` runs (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_linears(ops, x: torch.Tensor, ws: list) -> None:
    """x @ each packed weight of ws in turn (the stream over all of them is what is timed)."""
    for w in ws:
        ops.linear(x, w)


def weights(kind: str, k: int, n: int, count: int) -> list:
    """`count` random weights [n, k] of `kind` as the kernels hold them."""
    from bestiary.core.format import packing
    from bestiary.core.kernels.cpu import ops

    if kind.startswith(("bf16", "fp32")):
        dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
        if kind.endswith(" T"):
            return [ops.PackedWeight.transposed(torch.randn(k, n).to(dtype)) for _ in range(count)]
        return [ops.PackedWeight.tiled(packing.pack_float_tiled(torch.randn(n, k).to(dtype))) for _ in range(count)]
    if kind == "int8":
        return [ops.PackedWeight.int8(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n))
                for _ in range(count)]
    return [ops.PackedWeight.int4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // 64), None, 64)
            for _ in range(count)]


def gemv_rows(layers: int, repeats: int) -> None:
    from bestiary.core.kernels.cpu import ops

    print(f"{'kind':6s} {'K x N':>10s} {'cold GB/s':>10s} {'in cache GB/s':>14s}")
    for k, n in SHAPES:
        x = torch.randn(1, k).bfloat16()
        for kind in ("bf16", "bf16 T", "fp32", "fp32 T", "int8", "int4"):
            rates = []
            for count in (layers, 1):
                ws = weights(kind, k, n, count)
                seconds = best_seconds(functools.partial(run_linears, ops, x.float() if kind.startswith("fp32") else x, ws), repeats)
                rates.append(sum(w.nbytes for w in ws) / seconds / 1e9)
            print(f"{kind:6s} {f'{k}x{n}':>10s} {rates[0]:10.1f} {rates[1]:14.1f}")


def attention_row(layers: int, repeats: int, batch: int, keys: int) -> None:
    from bestiary.core.kernels.cpu import ops

    heads, kv_heads, dim, block = 9, 3, 64, 32
    blocks = -(-keys // block)
    pools = [(torch.randn(batch * blocks, block, kv_heads, dim).bfloat16(),
              torch.randn(batch * blocks, block, kv_heads, dim).bfloat16()) for _ in range(layers)]
    q = torch.randn(batch, heads, dim).bfloat16()
    tables = torch.arange(batch * blocks).reshape(batch, blocks)
    lens = torch.full((batch,), keys)
    seconds = best_seconds(lambda: [ops.decode_attention(q, k, v, tables, lens, dim ** -0.5) for k, v in pools], repeats)
    print(f"decode attention, {batch} sequences x {keys} keys, bf16 pools cold: {1e6 * seconds / layers:.0f} us a layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--keys", type=int, default=80)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gemv_rows(args.layers, args.repeats)
    attention_row(args.layers, args.repeats, args.batch, args.keys)


if __name__ == "__main__":
    main()
