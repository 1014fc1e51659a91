"""The compiled LoRA record (kernels.c bst_lora_rows, core.kernels.cpu.ops.lora_rows_): each row gets only its
own adapter's update, against StepLora's mask form (core.lora.batch) and the layout's torch reference.

Every build this CPU runs (the cpu_build fixture), float32 and bfloat16 models; adapters of ranks 4, 8
and 16 with different scalings, rows without adapter, a piece whose B reaches only some columns (a q
piece of a fused qkv) and two pieces of one adapter on the same columns (merged into one).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bestiary.core.kernels.cpu import build, ops
from bestiary.core.layers.linear import Parallel
from bestiary.core.lora.adapter import LoraAdapter, LoraPiece
from bestiary.core.lora.batch import AdapterStack, StepLora

# skipped only where nothing can build the kernels: with a compiler, a kernels.c that does not build
# fails here (tests/kernels/cpu/test_cpu_isa.py::test_kernels_build_where_a_compiler_is) instead of skipping
pytestmark = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                reason="no C compiler (or BESTIARY_CPU_KERNELS=off): the kernels are not built")

K, N_X, N_Y = 70, 40, 37  # odd sizes: vector tails in both matmuls
KEY = (("l.x", -1, N_X), ("l.y", -1, N_Y))  # a site of two linears side by side: columns [x | y]
SLOTS = [2, -1, 0, 1, 3, 0, -1, 2, 1]  # the adapter of each row (-1: the base model)
MODULES = tuple(SimpleNamespace(name=name, out_features=rows, parallel=Parallel.COLUMN, tp_size=1)
                for name, _, rows in KEY)  # stand-ins for the two Linears (StepLora keys a site by them)


def _piece(rank: int, rows: int, scaling: float, gen: torch.Generator, live: slice | None = None,
           k: int = K) -> LoraPiece:
    b = torch.randn(rows, rank, generator=gen)
    if live is not None:  # B reaches only these rows (a q / k / v piece of a fused qkv)
        keep = torch.zeros(rows, 1)
        keep[live] = 1
        b = b * keep
    return LoraPiece("m", torch.randn(rank, k, generator=gen) / k**0.5, b, scaling)


def _adapters(gen: torch.Generator) -> list[LoraAdapter]:
    return [
        LoraAdapter("r4", None, {("l.x", -1): [_piece(4, N_X, 0.5, gen)],
                                 ("l.y", -1): [_piece(4, N_Y, 0.5, gen)]}),
        LoraAdapter("r8", None, {("l.x", -1): [_piece(8, N_X, 2.0, gen, live=slice(8, 24))]}),
        LoraAdapter("r16", None, {("l.y", -1): [_piece(16, N_Y, 3.0, gen)]}),
        LoraAdapter("two", None, {("l.x", -1): [_piece(4, N_X, 1.25, gen, live=slice(0, 20)),
                                                _piece(8, N_X, -0.75, gen, live=slice(10, 40))]}),
    ]


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def case(request):
    """(stack of the four adapters in the model dtype, x [T, K], out [T, N], the step's StepLora)."""
    dtype = request.param
    gen = torch.Generator().manual_seed(7)
    adapters = _adapters(gen)
    for adapter in adapters:  # held in the model dtype, as load_adapter places them
        for pieces in adapter.pieces.values():
            for p in pieces:
                p.a, p.b = p.a.to(dtype), p.b.to(dtype)
    stack = AdapterStack(adapters, dtype, "cpu")
    x = torch.randn(len(SLOTS), K, generator=gen).to(dtype)
    out = (0.1 * torch.randn(len(SLOTS), N_X + N_Y, generator=gen)).to(dtype)
    return stack, x, out, StepLora(stack, [1] * len(SLOTS), SLOTS)


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2  # bf16 out: one rounding of each sum


def _rel_err(y: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> float:
    """Max difference of the updates relative to the largest update."""
    return ((y.float() - ref.float()).abs().max() / (ref.float() - base.float()).abs().max()).item()


def test_each_row_gets_its_own_adapter(cpu_build, case):
    stack, x, out, step = case
    site = stack.site(KEY)
    ours, want = out.clone(), out.clone()
    ops.lora_rows_(x, site.rows, step.token_slot, ours)
    step.add_(MODULES, x, want)  # the mask form: every adapter's ranks for every row, then masked
    assert _rel_err(ours, want, out) <= _tol(x.dtype)
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(ours[base], out[base])  # rows without adapter: untouched
    ref = out.clone()
    ops.lora_rows_ref(x, site.rows, step.token_slot, ref)
    assert _rel_err(ours, ref, out) <= _tol(x.dtype)


def test_the_layout_keeps_only_live_columns(case):
    """The r8 piece reaches columns 8..23 only; the two overlapping pieces of `two` become one."""
    stack, *_ = case
    rows = stack.site(KEY).rows
    assert rows.pieces(1) == [(8, 8, 8, 16, 4 * N_X + 4 * N_Y)]  # r0, rank, n0, rows, b_off
    assert [p[1:4] for p in rows.pieces(3)] == [(12, 0, 40)]
    assert [p[1:4] for p in rows.pieces(0)] == [(4, 0, N_X), (4, N_X, N_Y)]
    ranks = sum(p.rank for a in stack.adapters for ps in a.pieces.values() for p in ps)
    assert rows.b.numel() < ranks * (N_X + N_Y)  # the mask form's B_cat: every rank over every column


def test_rows_without_adapter_are_left_alone(cpu_build, case):
    stack, x, out, _ = case
    rows = stack.site(KEY).rows
    ours = out.clone()
    ops.lora_rows_(x, rows, torch.full((len(SLOTS),), -1), ours)
    assert torch.equal(ours, out)


def test_rows_split_over_threads_give_the_one_thread_result(cpu_build):
    """Enough work (rank 16, K 1030, 24 rows) that the kernel splits the rows over threads: the same bits."""
    gen = torch.Generator().manual_seed(3)
    k, n = 1030, 500
    stack = AdapterStack([LoraAdapter(f"a{i}", None, {("l.x", -1): [_piece(16, n, 1.0 + i, gen, k=k)]})
                          for i in range(3)], torch.bfloat16, "cpu")
    rows = stack.site((("l.x", -1, n),)).rows
    x = torch.randn(24, k, generator=gen).bfloat16()
    idx = torch.tensor([i % 4 - 1 for i in range(24)])
    out = torch.zeros(24, n, dtype=torch.bfloat16)
    results = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 4):
            torch.set_num_threads(t)
            results.append(out.clone())
            ops.lora_rows_(x, rows, idx, results[-1])
    finally:
        torch.set_num_threads(threads)
    ref = out.clone()
    ops.lora_rows_ref(x, rows, idx, ref)
    assert torch.equal(results[0], results[1]) and _rel_err(results[1], ref, out) <= 1e-2
