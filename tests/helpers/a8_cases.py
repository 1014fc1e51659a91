"""Inputs and checks shared by the int8-activation kernel tests (test_cpu_linear_a8: int8 x int8,
test_cpu_linear_w4a8: int4 x int8): the same hard inputs for both kernels, and the batch / thread invariance
both promise (test_cpu_linear_int4q's int4 quads x float inputs promise it too)."""

from __future__ import annotations

import torch

from bestiary.core.kernels.cpu import ops


def hard_inputs(m: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] in `dtype` (random, times 3) with an outlier 50 in row 0 (the rest of its block gets a coarse
    grid) and, when m > 2, an all-zero row 2 (its output must be exact zeros); bias [n] float32."""
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0, k // 2] = 50.0
    if m > 2:
        x[2] = 0.0
    return x, torch.randn(n, generator=gen)


def assert_rows_do_not_depend_on_the_batch(pw: ops.PackedWeight) -> None:
    """Each of 11 bfloat16 input rows gives the same float32 bits alone, in a slice of the batch and in the whole
    batch, on 1 and 2 threads (sums in a fixed order per row)."""
    x = torch.randn(11, pw.k, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = ops.linear(x, pw, out_dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(ops.linear(x, pw, out_dtype=torch.float32), whole)
            for i in range(11):
                assert torch.equal(ops.linear(x[i:i + 1], pw, out_dtype=torch.float32), whole[i:i + 1])
            assert torch.equal(ops.linear(x[3:9], pw, out_dtype=torch.float32), whole[3:9])
    finally:
        torch.set_num_threads(threads)
