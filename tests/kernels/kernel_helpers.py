"""Tolerances of the kernel tests (imported as `kernel_helpers`; tests/kernels is on sys.path).

A kernel output passes when max|out - ref| <= TOL[dtype] * max(1, max|ref|). The bounds
cover one rounding of the output plus accumulation-order differences: bf16 allows two
ulps (the interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest), fp16
two ulps, fp32 ~100 ulps of reordered sums. A "broken" variant must miss by MISS x that.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from bestiary.core.kernels.attention_ref import write_kv
from bestiary.core.kernels.metadata import AttentionMetadata

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
MISS = 100.0
ON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
# A JSON-lines file that every assert_close appends its test, dtype, max error and bound to (the GPU
# check's kernel table, benchmarks/gpu_check.py); unset: nothing is written.
ERRORS_FILE = os.environ.get("BESTIARY_KERNEL_ERRORS")

# tl.dot on bfloat16 is wrong under the interpreter (triton issue 11584): the dot kernels
# are checked in bf16 on a GPU only.
DOT_DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(ON_INTERPRETER, reason="interpreter: bf16 tl.dot")),
]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bound(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The pass bound for `ref` computed in `dtype`."""
    return TOL[dtype] * max(1.0, ref.float().abs().max().item())


def diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in float32 (shapes must match)."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    return (out.float().cpu() - ref.float().cpu()).abs().max().item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """out matches ref within the dtype's tolerance; both finite (an inf in ref made the bound inf,
    so a reference dividing by sin = 0 passed: `make mutation`, rotary apply_rotary_ref 22, 26)."""
    finite = bool(torch.isfinite(ref).all() and torch.isfinite(out).all())
    d, b = (diff(out, ref), bound(ref, dtype)) if finite else (float("nan"), float("nan"))
    record_error(dtype, d, b)
    assert finite, f"{dtype}: non-finite output or reference"
    assert d <= b, f"{dtype}: max |out - ref| = {d:.3g} > bound {b:.3g}"


def assert_far(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """A deliberately broken variant misses ref by at least MISS x the bound."""
    d, b = diff(out, ref), bound(ref, dtype)
    assert d >= MISS * b, f"{dtype}: broken variant only {d:.3g} away (< {MISS:g} x {b:.3g}): the test cannot fail"


def paged_inputs(seq_lens, ctx_lens, h, kvh, d, dtype, device, block_size: int = 5, **meta_kwargs):
    """(q, k, v, meta, k_pool, v_pool) of packed sequences over shuffled block tables, the new k/v already
    written to the pools; every other slot holds garbage (reading past a sequence shows)."""
    need = [-(-(c + n) // block_size) for n, c in zip(seq_lens, ctx_lens)]
    order = torch.randperm(sum(need) + 2).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    meta = AttentionMetadata.build(seq_lens, ctx_lens, tables, block_size, device=device, **meta_kwargs)
    t = sum(seq_lens)
    k_pool = (torch.randn(sum(need) + 2, block_size, kvh, d) * 3).to(dtype).to(device)  # cached keys + garbage
    v_pool = (torch.randn(sum(need) + 2, block_size, kvh, d) * 3).to(dtype).to(device)
    qkv = torch.randn(t, h + 2 * kvh, d).to(dtype).to(device)  # q, k, v as strided views of one tensor
    q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
    write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
    return q, k, v, meta, k_pool, v_pool


def sequence_kv(meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor, b: int, length: int,
                heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values at positions 0..length-1, gathered from the pools' slots through
    its block table and repeated over the query heads (GQA): (pos [L], k [L, H, D], v [L, H, D]),
    float32 on the CPU (the written-out references of the attention tests)."""
    tables, bs = meta.block_tables.cpu(), k_pool.shape[1]
    pos = torch.arange(length)
    slots = tables[b, pos // bs] * bs + pos % bs
    kk, vv = k_pool.flatten(0, 1).cpu().float()[slots], v_pool.flatten(0, 1).cpu().float()[slots]  # [L, KVH, D]
    return pos, kk.repeat_interleave(heads // kk.shape[1], 1), vv.repeat_interleave(heads // vv.shape[1], 1)


def record_error(dtype: torch.dtype, err: float, limit: float) -> None:
    """Append {test, dtype, max_err, bound} to ERRORS_FILE (when set) for the GPU check's table."""
    if ERRORS_FILE:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        row = {"test": test, "dtype": str(dtype).removeprefix("torch."), "max_err": err, "bound": limit}
        with open(ERRORS_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
