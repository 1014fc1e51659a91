"""The linears of one transformer layer in each CPU mode, at a given number of rows (issue 53).

For each row count (1: a batch-1 decode step; 32: a decode step of 32 sequences; 512: a prefill
chunk) times the layer's linears (SmolLM2-135M by default: fused qkv 960 x 576, dense 576 x 576,
fused fc + gate 3,072 x 576, proj 576 x 1,536; --lm_head adds the 49,152 x 576 head at the row
counts up to 32, as decode steps run it) the way each engine mode runs them:

    bf16    bfloat16 weights in row tiles, core.layers.cpu_matmul.matmul_tiled (the compiled kernel at
            any row count: batch-invariant)
    w8a16   int8 row tiles, the weight-only slot's path: the GEMV up to its kernel bound, then the
            weight dequantized and one dense GEMM (bf16 where the CPU has native bf16 GEMMs, else fp32)
    w8a8    the same tiles, int8 activations quantized per row and 64-feature block (linear_a8.c)
    w4a16   int4 groups of 128 (symmetric, the layout the slot keeps on this build), the weight-only slot's
            path: the int4 GEMV up to its kernel bound, then dequantized and one dense GEMM
    w4a8    the same int4 codes (checkpoint layout), int8 activations as w8a8's (linear_w4a8.c)
    w8a16_plan, w4a16_plan
            the same weights through the compiled GEMV at any row count: what a decode step run by the
            compiled plan (core.runtime.cpu_plan: every decode step of up to 128 sequences) does, where
            w8a16 / w4a16 are an eager step's (a prefill chunk, a step mixing prompts and decodes)

Random weights of the real sizes; --layers different weights per mode run in turn (as a model's
layers do: nothing stays in cache from one call to the next); alternated rounds, the median of
each mode's best-of-repeats. Prints milliseconds per layer and each mode's speed against bf16.

    python benchmarks/linear_modes.py [--rows 1 32 512] [--threads 2] [--rounds 5] [--lm_head]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bestiary.core.format import packing
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.cpu import build
from bestiary.core.layers import cpu_matmul
from bestiary.core.quant import slot

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one layer's linears
LM_HEAD = (49152, 576)
MODES = ["bf16", "w8a16", "w8a8", "w4a16", "w4a8", "w8a16_plan", "w4a16_plan"]
INT4_GROUP = 128


def int8_codes(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-channel int8 weights: codes [n, k] and scales [n]."""
    w = torch.randn(n, k, generator=gen) * 0.02
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def weight_only(pw, bits: int, plan: bool = False) -> Callable:
    """The weight-only slot's path on `pw`: the compiled GEMV up to the build's kernel bound (`plan`: at any row
    count, as a decode plan runs it), else the weight dequantized (bf16 where the CPU has native bf16 GEMMs, else
    fp32) and one dense GEMM."""
    ops = dispatch.cpu_ops()
    bound = slot.COMPILED_MAX_TOKENS.get(build.isa_name(build.library()), {}).get(bits, slot.DEFAULT_MAX_KERNEL_TOKENS)
    bound = 1 << 30 if plan else bound
    dtype = torch.bfloat16 if cpu_matmul.native_half_gemm(torch.bfloat16) else torch.float32

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= bound:
            return ops.linear(x, pw)
        return F.linear(x.to(dtype), ops.dequantize(pw, dtype)).to(x.dtype)

    return run


def make_linears(mode: str, shapes: list[tuple[int, int]], gen: torch.Generator) -> list[Callable]:
    """One callable per shape, x [T, K] bf16 -> [T, N], running `mode`'s path."""
    ops = dispatch.cpu_ops()
    out: list[Callable] = []
    for n, k in shapes:
        if mode == "bf16":
            tiles = packing.pack_float_tiled((torch.randn(n, k, generator=gen) * 0.02).bfloat16())
            out.append(lambda x, t=tiles: cpu_matmul.matmul_tiled(x, t))
        elif mode in ("w4a16", "w4a8", "w4a16_plan"):
            codes, s, _ = packing.quantize_int4_groupwise(torch.randn(n, k, generator=gen) * 0.02, INT4_GROUP, False)
            packed = packing.pack_int4(codes)
            if mode == "w4a8":
                pw = ops.PackedWeight.int4_a8(packed, s, None, INT4_GROUP)
                out.append(lambda x, p=pw: ops.linear(x, p))
            else:
                out.append(weight_only(ops.PackedWeight.int4(packed, s, None, INT4_GROUP), 4, mode.endswith("plan")))
        else:
            q, s = int8_codes(n, k, gen)
            tiles = packing.pack_int8_tiled(q)
            if mode == "w8a8":
                pw = ops.PackedWeight.int8_a8(tiles, s)
                out.append(lambda x, p=pw: ops.linear(x, p))
            else:
                out.append(weight_only(ops.PackedWeight.int8(tiles, s, tiled=True), 8, mode.endswith("plan")))
    return out


def time_layers(layers: list[list[Callable]], x: dict[int, torch.Tensor], repeats: int) -> float:
    """Best over `repeats` of one pass through every layer's linears, seconds per layer."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for linears in layers:
            for fn in linears:
                fn(x[id(fn)])
        best = min(best, time.perf_counter() - start)
    return best / len(layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512], help="rows per call (tokens of a step)")
    parser.add_argument("--threads", type=int, default=2, help="torch and kernel threads")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (the median is printed)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per round (the best is kept)")
    parser.add_argument("--layers", type=int, default=8, help="layers of different weights per mode")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES, help="modes to time")
    parser.add_argument("--lm_head", action="store_true", help="add the 49,152 x 576 head at rows <= 32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"kernel build {build.isa_name(build.library())}, {args.threads} threads, "
          f"native bf16 GEMM: {cpu_matmul.native_half_gemm(torch.bfloat16)}")
    print("| rows | " + " | ".join(f"{m} ms" for m in args.modes) + " | " +
          " | ".join(f"{m} vs bf16" for m in args.modes if m != "bf16") + " |")
    print("|---" * (1 + 2 * len(args.modes) - ("bf16" in args.modes)) + "|")
    with torch.inference_mode():
        for rows in args.rows:
            shapes = SMOLLM2 + ([LM_HEAD] if args.lm_head and rows <= 32 else [])
            layers = {m: [make_linears(m, shapes, gen) for _ in range(args.layers)] for m in args.modes}
            x = {id(fn): torch.randn(rows, k, generator=gen).bfloat16()
                 for m in args.modes for linears in layers[m] for fn, (_, k) in zip(linears, shapes)}
            times: dict[str, list[float]] = {m: [] for m in args.modes}
            for _ in range(args.rounds):
                for m in args.modes:
                    times[m].append(time_layers(layers[m], x, args.repeats))
            med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
            ratios = [f"{med['bf16'] / med[m]:.2f}x" if "bf16" in med else "" for m in args.modes if m != "bf16"]
            print(f"| {rows} | " + " | ".join(f"{med[m]:.2f}" for m in args.modes) + " | " + " | ".join(ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
