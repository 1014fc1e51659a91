"""Where torch's GEMM overtakes the compiled kernel on weights in row tiles (issue 27).

For each SmolLM2 linear shape (N x K: fused gate|up 3072x576, down 576x1536, fused qkv 960x576,
dense 576x576) and each row count, times the compiled kernel on the tiles (ops.linear) against
what matmul_tiled runs past its bound: the rows put back in order block by block, then
F.linear (in float32 for bf16 where the CPU has no native bf16 GEMM, as matmul_tiled does).
Each pass runs --layers different weights in turn, as a prefill step does (the weights out of
cache, torch's GEMM seeing new contents each call); best pass of --repeats.
Prints seconds(torch) / seconds(kernel): above 1 the kernel wins. The bound per kernel build,
core.layers.cpu_matmul.TILED_KERNEL_MAX_TOKENS, comes from this table. Force a build with
BESTIARY_CPU_ISA=avx512 / avx2 (and --no-native to time torch as a CPU without bf16 GEMM runs it).

--quant: the same for quantized weights as a bfloat16 W8A16 / W4A16 engine holds them (int8 in
row tiles, int4 group 64 in the layout this build reads) against what their slot runs past
max_kernel_tokens rows: `ops.dequantize` to bfloat16 (float32 without native bf16 GEMM), then
F.linear. core.quant.slot.COMPILED_MAX_TOKENS comes from this table.

    python benchmarks/tiled_crossover.py [--rows 33 64 128 256] [--threads 2] [--layers 16] [--no-native]
    python benchmarks/tiled_crossover.py --quant --rows 8 16 24 32 48 64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gemv_stream import best_seconds  # this folder's: the script's own directory is on sys.path

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[33, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--no-native", action="store_true", help="torch's side in fp32 for bf16 (no native bf16 GEMM)")
    parser.add_argument("--quant", action="store_true", help="int8 / int4 weights against dequantize + F.linear")
    args = parser.parse_args()
    if args.quant:
        quant_rows(args)
        return
    from bestiary.core.format import packing
    from bestiary.core.kernels.cpu import ops
    from bestiary.core.kernels.cpu.build import chosen_isa
    from bestiary.core.layers import cpu_matmul

    torch.set_num_threads(args.threads)
    if args.no_native:
        cpu_matmul.native_half_gemm = lambda _dtype: False
    cpu_matmul.tiled_kernel_max_tokens = lambda _dtype: 0  # matmul_tiled: always torch's side
    print(f"kernels {chosen_isa()}, {args.threads} threads; torch / kernel seconds (above 1: the kernel wins)")
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in SHAPES:
            layers = [packing.pack_float_tiled(torch.randn(n, k).to(dtype)) for _ in range(args.layers)]
            packed = [ops.PackedWeight.tiled(tiles) for tiles in layers]
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, k).to(dtype)
                kernel = best_seconds(lambda x=x, packed=packed: [ops.linear(x, p) for p in packed], args.repeats)
                torch_side = best_seconds(lambda x=x, layers=layers: [cpu_matmul.matmul_tiled(x, t) for t in layers],
                                          args.repeats)
                cells.append(f"{rows}: {torch_side / kernel:.2f}")
            print(f"{str(dtype).removeprefix('torch.'):9s} {n}x{k:<5d} " + "  ".join(cells))


def quant_rows(args) -> None:
    """The --quant table: int8 (row tiles) and int4 group 64 weights, bfloat16 inputs."""
    from bestiary.core.kernels.cpu import ops
    from bestiary.core.kernels.cpu.build import chosen_isa
    from bestiary.core.kernels.cpu.malloc import keep_freed_memory

    keep_freed_memory()  # as an engine runs: freed dequantized weights stay in the heap
    torch.set_num_threads(args.threads)
    gemm_dtype = torch.float32 if args.no_native else torch.bfloat16
    print(f"kernels {chosen_isa()}, {args.threads} threads; dequantize + F.linear ({gemm_dtype}) / kernel seconds")
    for kind in ("int8", "int4"):
        for n, k in SHAPES:
            if kind == "int8":
                packed = [ops.PackedWeight.int8(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) + 0.1)
                          for _ in range(args.layers)]
            else:
                packed = [ops.PackedWeight.int4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                                                (torch.rand(n, k // 64) + 0.1).bfloat16(), None, 64)
                          for _ in range(args.layers)]
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, k).bfloat16()
                kernel = best_seconds(lambda x=x, packed=packed: [ops.linear(x, p) for p in packed], args.repeats)
                torch_side = best_seconds(lambda x=x, packed=packed: [
                    F.linear(x.to(gemm_dtype), ops.dequantize(p, gemm_dtype)).bfloat16() for p in packed], args.repeats)
                cells.append(f"{rows}: {torch_side / kernel:.2f}")
            print(f"{kind:9s} {n}x{k:<5d} " + "  ".join(cells))


if __name__ == "__main__":
    main()
