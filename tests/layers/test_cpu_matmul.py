"""CPU float matmuls over transposed weights and row tiles (core.layers.cpu_matmul) equal F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bestiary.core.format import packing
from bestiary.core.kernels import dispatch
from bestiary.core.layers import cpu_matmul
from bestiary.core.layers.linear import Linear


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 9, 40])
def test_matmul_t_equals_linear(dtype, tokens, native, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "native_half_gemm", lambda _dtype: native)
    monkeypatch.setattr(cpu_matmul, "UPCAST_CHUNK", 96 * 50)  # several column blocks
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    x = torch.randn(tokens, 96, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    y = cpu_matmul.matmul_t(x, w.t().contiguous(), b)
    assert y.dtype == dtype and y.shape == (tokens, 130)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_linear_holds_its_weight_transposed_without_a_copy():
    lin = Linear(96, 130, bias=True)  # 130 rows: no row tiles
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    before = lin.weight.detach().clone()
    x = torch.randn(5, 96)
    ref = F.linear(x, before, lin.bias)
    lin.fuse()
    assert lin._wt is not None and lin._wt.is_contiguous() and lin._wt.shape == (96, 130)
    assert lin.weight.shape == (130, 96) and torch.equal(lin.weight, before)  # same parameter, same values
    assert lin.weight.data_ptr() == lin._wt.data_ptr()
    torch.testing.assert_close(lin(x), ref)
    assert torch.equal(lin.state_dict()["weight"], before)


def test_column_major_slices_are_not_copied():
    fused_t = torch.randn(96, 260)  # [K, 2N]: a gated MLP's fused weight held transposed
    param = torch.nn.Parameter(fused_t.t()[:130], requires_grad=False)  # [N, K] view, column-major
    wt = cpu_matmul.hold_transposed(param)
    assert wt.data_ptr() == fused_t.data_ptr() and wt.shape == (96, 130)


def test_cpu_flags_decide_native_half(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    assert not cpu_matmul.native_half_gemm(torch.bfloat16)
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert cpu_matmul.native_half_gemm(torch.bfloat16) and not cpu_matmul.native_half_gemm(torch.float16)


needs_kernels = pytest.mark.skipif(not dispatch.use_cpu_kernels(torch.zeros(1)), reason="no compiled CPU kernels")


@needs_kernels
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("past_bound", [-1000, -1, 0, 1, 8])  # rows: bound + this (at least 1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_in_row_tiles_equals_linear(dtype, past_bound, native, monkeypatch):
    """A bfloat16 / float32 Linear with N % 8 == 0, K % 32 / 16 == 0 is held in row tiles: the
    compiled kernel up to tiled_kernel_max_tokens(dtype) rows, above it torch's GEMM over blocks of
    rows put back in order (several blocks here; bf16 in float32 where the CPU has no native bf16
    GEMM). The parameter keeps its shape, its state_dict the values in order, and the output equals
    F.linear to a rounding of the output dtype."""
    bound = cpu_matmul.tiled_kernel_max_tokens(dtype)
    tokens = max(1, bound + past_bound)
    # the kernel runs every row count now (batch invariance); torch's side, as without the kernels, from bound + 1
    monkeypatch.setattr(cpu_matmul, "tiled_torch_from", lambda _dtype: bound + 1)
    # the CPU's flags decide (not a patched native_half_gemm: its dtype argument counts too)
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"} if native else {"avx2"}))
    calls, gemm_dtypes = [], []
    real, real_gemm = dispatch.cpu_ops().linear, F.linear
    monkeypatch.setattr(dispatch.cpu_ops(), "linear", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setattr(F, "linear", lambda x, *a, **kw: gemm_dtypes.append(x.dtype) or real_gemm(x, *a, **kw))
    monkeypatch.setattr(cpu_matmul, "UPCAST_CHUNK", 96 * 50)  # blocks of 48 rows: 3 blocks for 136
    lin = Linear(96, 136, bias=True, dtype=dtype)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    before = lin.weight.detach().clone()
    x = torch.randn(tokens, 96).to(dtype)
    ref = F.linear(x.float(), before.float(), lin.bias.float())
    memory = lin.weight.data_ptr()
    with cpu_matmul.repack_in_place():  # as an engine load does (its own reads)
        lin.fuse()
    assert lin._wt is None and lin._tiles is not None and lin._tiles.data_ptr() == lin.weight.data_ptr() == memory
    assert lin.weight.shape == (136, 96) and torch.equal(lin._tiles, packing.pack_float_tiled(before))
    assert torch.equal(lin.state_dict()["weight"], before)
    gemm_dtypes.clear()  # the reference's
    y = lin(x)
    assert y.dtype == dtype and y.shape == (tokens, 136)
    assert calls == ([tokens] if tokens <= bound else [])  # the kernel up to the bound, torch past it
    gemm = torch.float32 if dtype == torch.float32 or not native else dtype  # bf16 upcast without native bf16
    assert gemm_dtypes == ([] if tokens <= bound else [gemm] * 3)  # 3 blocks of rows
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    y3 = lin(x.view(1, tokens, 96))  # leading dims kept: [1, T, K] -> [1, T, N]
    assert y3.shape == (1, tokens, 136) and torch.equal(y3[0], y)


@needs_kernels
def test_tiled_kernel_bound_by_build(monkeypatch):
    """The bound is the kernel build's (bf16 / fp32 rows): 128 / 64 on avx512bf16 (torch's native bf16
    GEMM), 256 / 128 on avx512, 128 / 64 on avx2, KERNEL_MAX_TOKENS (32) on the scalar build."""
    from bestiary.core.kernels.cpu.build import ISAS

    for isa, bf16, fp32 in (("avx512bf16", 128, 64), ("avx512", 256, 128), ("avx2", 128, 64),
                           ("scalar", 32, 32)):
        lib = type("Lib", (), {"bst_isa": staticmethod(lambda code=ISAS[isa].code: code)})()
        monkeypatch.setattr(cpu_matmul, "library", lambda lib=lib: lib)
        assert (cpu_matmul.tiled_kernel_max_tokens(torch.bfloat16),
                cpu_matmul.tiled_kernel_max_tokens(torch.float32)) == (bf16, fp32), isa


@needs_kernels
def test_tiled_prefill_scratch_works_in_and_out_of_inference_mode(monkeypatch):
    """The reused scratch of matmul_tiled's long steps, first made under torch.inference_mode (the
    executor's), is written again outside it (a script, a test) and the other way round."""
    monkeypatch.setattr(cpu_matmul, "_scratch", type(cpu_matmul._scratch)())  # a fresh, empty scratch
    monkeypatch.setattr(cpu_matmul, "tiled_torch_from", lambda _dtype: 1)  # torch's side (as without the kernels)
    lin = Linear(96, 136, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    before = lin.weight.detach().clone()
    lin.fuse()
    x = torch.randn(cpu_matmul.tiled_kernel_max_tokens(torch.bfloat16) + 8, 96).bfloat16()  # torch's GEMM
    ref = F.linear(x.float(), before.float())
    with torch.inference_mode():
        inside = lin(x)
    outside = lin(x)
    with torch.inference_mode():
        again = lin(x)
    assert torch.equal(inside, outside) and torch.equal(outside, again)
    torch.testing.assert_close(outside.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    wide = Linear(192, 272, dtype=torch.bfloat16)  # 4x the scratch the first one left: it grows
    torch.nn.init.normal_(wide.weight)
    wide_before = wide.weight.detach().clone()
    wide.fuse()
    wide_ref = F.linear(x.repeat(1, 2).float(), wide_before.float())
    torch.testing.assert_close(wide(x.repeat(1, 2)).float(), wide_ref, rtol=1e-2, atol=1e-2 * wide_ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, unit", [(8, 32), (4, 32), (4, 1)])  # float / int8 tiles, int4 dot codes, its scales
def test_row_tiles_in_place_equals_row_tiles(dtype, rows, unit, monkeypatch):
    """row_tiles_in_place rewrites the tensor's own memory, a block of whole tiles at a time (several
    blocks and a short last tile here), to the values row_tiles makes; and back."""
    monkeypatch.setattr(packing, "REPACK_CHUNK_BYTES", 3 * 8 * 64 * 4)  # a block of 24 rows at most (float32)
    n, width = 8 * 7 + rows - 1, 64  # 7 blocks of 8 rows, then a short tile of rows - 1
    t = (torch.randn(n, width) * 50).to(dtype)
    tiled = packing.row_tiles(t, rows, unit, to_tiles=True)
    work = t.clone()
    memory = work.data_ptr()
    assert packing.row_tiles_in_place(work, rows, unit, to_tiles=True) is work and work.data_ptr() == memory
    assert torch.equal(work, tiled)
    assert torch.equal(packing.row_tiles_in_place(work, rows, unit, to_tiles=False), t)
    with pytest.raises(ValueError, match="contiguous"):
        packing.row_tiles_in_place(t.t(), rows, unit, to_tiles=True)


def test_hold_tiled_copies_a_view_of_a_larger_buffer():
    """hold_tiled repacks in place only a parameter that owns its memory: one that is a view of a larger
    buffer (another tensor's rows) gets tiles of its own, the buffer untouched."""
    buffer = torch.randn(32, 64).bfloat16()
    kept = buffer.clone()
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(buffer[8:24], requires_grad=False)
    with cpu_matmul.repack_in_place():
        tiles = cpu_matmul.hold_tiled(module, "w")
    assert torch.equal(buffer, kept) and torch.equal(tiles, packing.pack_float_tiled(kept[8:24]))
    assert cpu_matmul.owns_memory(torch.zeros(4, 4)) and not cpu_matmul.owns_memory(buffer[8:24])


def test_hold_tiled_never_rewrites_a_callers_tensor():
    """Outside an engine load (repack_in_place) a parameter that shares a caller's whole tensor (a model built
    from a reference model's weights, as the linter and the converters build one) gets tiles of its own: the
    caller's tensor keeps its values. (The in-place repack once scrambled the reference model's weights.)"""
    theirs = torch.randn(16, 64).bfloat16()
    kept = theirs.clone()
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(theirs, requires_grad=False)  # the same memory, owned whole
    assert cpu_matmul.owns_memory(module.w.data)
    tiles = cpu_matmul.hold_tiled(module, "w")
    assert torch.equal(theirs, kept) and tiles.data_ptr() != theirs.data_ptr()
    assert torch.equal(tiles, packing.pack_float_tiled(kept))


@needs_kernels
def test_two_tiled_parameters_of_one_module_keep_their_state_dict():
    """hold_tiled on two parameters of one module: one state_dict hook, both given back in order."""
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.randn(16, 64).bfloat16(), requires_grad=False)
    module.b = torch.nn.Parameter(torch.randn(8, 128).bfloat16(), requires_grad=False)
    a, b = module.a.detach().clone(), module.b.detach().clone()
    cpu_matmul.hold_tiled(module, "a")
    cpu_matmul.hold_tiled(module, "b")
    assert not torch.equal(module.a, a) and not torch.equal(module.b, b)  # held in tiles
    state = module.state_dict()
    assert torch.equal(state["a"], a) and torch.equal(state["b"], b)


def test_weights_that_do_not_fit_the_tiles_stay_transposed():
    """Row tiles only for bfloat16 [N % 8 == 0, K % 32 == 0] and float32 [N % 8 == 0, K % 16 == 0]:
    other shapes keep W^T."""
    for n, k, dtype in ((130, 96, torch.bfloat16), (136, 80, torch.bfloat16), (130, 96, torch.float32),
                        (136, 72, torch.float32)):
        lin = Linear(k, n, dtype=dtype)
        lin.fuse()
        assert lin._tiles is None and lin._wt is not None and lin._wt.shape == (k, n)


@needs_kernels
def test_gated_mlp_fuses_into_row_tiles_and_embedding_reads_them():
    """GatedMLP: fc | gate fused in row tiles, each a block of whole tiles that is its own weight
    (state_dict in order, its own forward); an embedding sharing a tiled weight looks its rows up."""
    from bestiary.core.layers.embedding import Embedding
    from bestiary.core.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, "silu", bias=False, tp_rank=0, tp_size=1, dtype=torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fc, gate, proj = (m.weight.detach().clone() for m in (mlp.fc, mlp.gate, mlp.proj))
    x = torch.randn(3, 64).bfloat16()
    xf = x.float()
    ref = F.linear(F.silu(F.linear(xf, fc.float())) * F.linear(xf, gate.float()), proj.float())
    mlp.fuse()
    for m in (mlp.fc, mlp.gate, mlp.proj):
        m.fuse()
    assert mlp._fused_tiles is not None and mlp._fused_tiles.shape == (192, 64)
    assert mlp.fc.weight.data_ptr() == mlp._fused_tiles.data_ptr()
    sd = mlp.state_dict()
    assert torch.equal(sd["fc.weight"], fc) and torch.equal(sd["gate.weight"], gate) and torch.equal(sd["proj.weight"], proj)
    torch.testing.assert_close(mlp(x).float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    torch.testing.assert_close(mlp.gate(x).float(), F.linear(xf, gate.float()), rtol=1e-2, atol=1e-2)

    emb = Embedding(48, 64, dtype=torch.bfloat16)
    torch.nn.init.normal_(emb.weight)
    table = emb.weight.detach().clone()
    emb._tiles = cpu_matmul.hold_tiled(emb)
    ids = torch.tensor([0, 47, 9, 9, 16, 31])
    assert torch.equal(emb(ids), table[ids]) and torch.equal(emb.state_dict()["weight"], table)
    assert torch.equal(cpu_matmul.tiled_rows(emb._tiles, ids.view(2, 3)), table[ids].view(2, 3, 64))
