"""core/layers/mlp.py and core/layers/cpu_matmul.py contracts that `make mutation` (tests/mutation_run.py
layers_numerics) found untested.

Each test names the mutants it kills; the references are written out in the test with torch.
Where a contract is about which path runs (the fused gate matmul, the compiled bf16 GEMV, the fp32
upcast of half GEMMs), a spy wraps the real function and the output is still checked.
"""

from __future__ import annotations

import pytest
import torch

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.activations_ref import activation
from bestiary.core.layers import cpu_matmul
from bestiary.core.layers.linear import Linear
from bestiary.core.layers.mlp import MLP, GatedMLP
from bestiary.core.quant.modes import LinearQuant
from bestiary.core.quant.slot import WeightOnlySlot

H, INTER = 8, 12  # hidden != inter != 2 * inter (a swapped dim is a shape error or a wrong slice)
FP32_TOL = dict(rtol=1e-4, atol=1e-4)


def _silu(z: torch.Tensor) -> torch.Tensor:
    return z * torch.sigmoid(z)


def _relu(z: torch.Tensor) -> torch.Tensor:
    return z.clamp_min(0)


def _filled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn from N(0, 0.5^2) (they start as torch.empty)."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(0.5 * torch.randn(p.shape, generator=g).to(p.dtype))
    return module


def _prepare(module: torch.nn.Module) -> None:
    """What DecoderLM.prepare_for_inference does: every submodule's fuse(), parents first."""
    for m in module.modules():
        if hasattr(m, "fuse"):
            m.fuse()


class _Lora:
    """A LoRA delta written out: module m with adapter (A [r, in], B [out, r]) adds x A^T B^T; concat of
    several linears reading the same x is their deltas side by side (zeros for one without adapter)."""

    def __init__(self, adapters: dict, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ab = {m: (torch.randn(2, m.weight.shape[1], generator=g), torch.randn(m.weight.shape[0], 2, generator=g))
                   for m in adapters}

    def delta(self, m: Linear, x: torch.Tensor) -> torch.Tensor:
        a, b = self.ab[m]
        return x @ a.t() @ b.t()

    def __call__(self, module: Linear, x: torch.Tensor) -> torch.Tensor | None:
        return self.concat((module,), x)

    def concat(self, modules, x: torch.Tensor) -> torch.Tensor | None:
        if not any(m in self.ab for m in modules):
            return None
        return torch.cat([self.delta(m, x) if m in self.ab else x.new_zeros(x.shape[0], m.weight.shape[0])
                          for m in modules], dim=-1)


def _gated_reference(x, w, lora=None, act=_silu):
    """proj(act(fc(x)) * gate(x)) with each linear's LoRA delta, from the weights `w` taken before fuse()."""
    def lin(name, z):
        y = z @ w[name + ".weight"].t()
        if lora is not None and name in lora:
            y = y + lora[name](z)
        return y + w[name + ".bias"] if name + ".bias" in w else y

    return lin("proj", act(lin("fc", x)) * lin("gate", x))


def _named_lora(mlp, lora: _Lora) -> dict:
    def delta(module):
        return lambda z: lora.delta(module, z)

    return {name: delta(getattr(mlp, name)) for name in ("fc", "gate", "proj") if getattr(mlp, name, None) in lora.ab}


# --- mlp.py --------------------------------------------------------------------------------------


def test_unknown_activation_is_refused_naming_it_and_the_supported_ones() -> None:
    """activation(): an unsupported hidden_act is a ValueError that names it and lists the supported
    names (mlp activation 1: no message, 2: sorted(None) raises a TypeError instead)."""
    with pytest.raises(ValueError, match=r"hidden_act 'swish2' is not supported; expected one of \[.*'gelu_new'.*'silu'"):
        activation("swish2")


@pytest.mark.parametrize("cls", [GatedMLP, MLP])
def test_mlp_linears_hold_the_ranks_slice_in_the_asked_dtype_and_device(cls) -> None:
    """GatedMLP / MLP: fc (and gate) column-parallel [INTER / tp, H], proj row-parallel [H, INTER / tp], each knowing
    its tp_rank / tp_size, all in the asked dtype on the asked device; `act` is the activation called
    act_name (GatedMLP.__init__ 10, 13, 16, 19, 37, 40, 45, 48, 49; MLP.__init__ 6, 8, 9, 14, 16, 17, 23, 25,
    26, 31, 33, 34, 35)."""
    m = cls(H, INTER, "relu", True, 1, 2, torch.bfloat16, device="meta")
    cols = [m.fc] + ([m.gate] if cls is GatedMLP else [])
    for lin, shape in [(c, (INTER // 2, H)) for c in cols] + [(m.proj, (H, INTER // 2))]:
        assert (lin.tp_rank, lin.tp_size) == (1, 2)
        for p in (lin.weight, lin.bias):
            assert p.dtype == torch.bfloat16 and p.device.type == "meta"
        assert lin.weight.shape == shape
    z = torch.linspace(-3, 3, 13)
    assert m.act_name == "relu" and torch.equal(m.act(z), _relu(z))


def test_gated_mlp_unfused_equals_the_formula_with_lora() -> None:
    """Before fuse(): y = proj(silu(fc(x)) * gate(x)) with biases, each linear adding its own LoRA delta
    (GatedMLP.forward 6-26: the unfused path's arguments; __init__ 52: no fused weight yet)."""
    mlp = _filled(GatedMLP(H, INTER, "silu", True, 0, 1, torch.float32), seed=1)
    w = {k: v.clone() for k, v in mlp.state_dict().items()}
    lora = _Lora([mlp.fc, mlp.gate, mlp.proj], seed=2)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(mlp(x, lora), _gated_reference(x, w, _named_lora(mlp, lora)), **FP32_TOL)
    torch.testing.assert_close(mlp(x), _gated_reference(x, w), **FP32_TOL)


@pytest.mark.parametrize("adapters", ["all", "fc_only"])
def test_gated_mlp_fused_on_the_cpu_runs_one_gate_matmul_and_keeps_lora(adapters, monkeypatch) -> None:
    """After prepare (GatedMLP.fuse, then each Linear's): the output is still the formula, LoRA deltas of
    fc / gate added to the fused [T, 2I] output and proj's to its own, and fc + gate run as one
    cpu_matmul.matmul_t over the transposed fused weight [H, 2I] (GatedMLP.forward 5, 7, 31-34: the fused
    CPU path skipped; 49-63: the fused LoRA delta lost, negated or called wrong)."""
    mlp = _filled(GatedMLP(H, INTER, "silu", True, 0, 1, torch.float32), seed=4)
    w = {k: v.clone() for k, v in mlp.state_dict().items()}
    lora = _Lora([mlp.fc, mlp.gate, mlp.proj] if adapters == "all" else [mlp.fc], seed=5)
    _prepare(mlp)
    shapes = []
    real = cpu_matmul.matmul_t

    def spy(x, wt, bias=None):
        shapes.append(tuple(wt.shape))
        return real(x, wt, bias)

    monkeypatch.setattr(cpu_matmul, "matmul_t", spy)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(mlp(x, lora), _gated_reference(x, w, _named_lora(mlp, lora)), **FP32_TOL)
    assert shapes[0] == (H, 2 * INTER) and (H, INTER) not in shapes  # one matmul for fc + gate, none apart


def test_gated_mlp_fuse_keeps_the_state_dict_and_holds_the_weights_once() -> None:
    """fuse() (then the Linears' fuse, as prepare_for_inference runs them) leaves the state dict as loaded
    (names, shapes, values) and fc / gate weights are views of one fused CPU buffer, not copies: on the
    CPU it is held transposed so Linear.fuse finds them column-major and does not copy them
    (GatedMLP.fuse 2, 3: float weights sent to the quantized fusion; 8, 9: fc / gate sliced at the wrong
    row; 12-14: the fused weight not held transposed on the CPU)."""
    mlp = _filled(GatedMLP(H, INTER, "gelu_pytorch_tanh", True, 0, 1, torch.float32), seed=7)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    _prepare(mlp)
    after = mlp.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].shape == v.shape and torch.equal(after[k], v), k
    storage = mlp.fc.weight.untyped_storage().data_ptr()
    assert mlp.gate.weight.untyped_storage().data_ptr() == storage
    assert mlp.fc.bias.untyped_storage().data_ptr() == mlp.gate.bias.untyped_storage().data_ptr()
    assert mlp.fc.weight.stride(0) == 1 and mlp.gate.weight.stride(0) == 1  # column-major views of W^T


def test_gated_mlp_fused_off_the_cpu_multiplies_the_fused_weight_as_is() -> None:
    """A GatedMLP fused on a non-CPU device (meta here: shapes only) computes the fused gate output
    F.linear(x, [2I, H], bias) and returns [T, H] on that device (GatedMLP.forward 42-44, 46, 47)."""
    for bias in (True, False):
        mlp = GatedMLP(H, INTER, "silu", bias, 0, 1, torch.float32, device="meta")
        _prepare(mlp)
        y = mlp(torch.empty(3, H, device="meta"))
        assert y.shape == (3, H) and y.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gated_mlp_fused_on_cuda_equals_the_formula() -> None:
    """Fused on a CUDA device (no transposed copy there), y = proj(silu(fc(x)) * gate(x)) with the fused
    bias of fc / gate added (GatedMLP.forward 45, 48: the fused bias dropped; skipped without a GPU)."""
    mlp = _filled(GatedMLP(H, INTER, "silu", True, 0, 1, torch.float32), seed=27)
    w = {k: v.clone() for k, v in mlp.state_dict().items()}
    mlp = mlp.to("cuda")
    _prepare(mlp)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(28))
    y = mlp(x.to("cuda"))
    assert y.device.type == "cuda"
    torch.testing.assert_close(y.cpu(), _gated_reference(x, w), rtol=1e-3, atol=1e-3)


def _int8_linear(lin: Linear, seed: int) -> torch.Tensor:
    """Make `lin` a W8A16 layer with codes q int8 [N, K] and per-row scales s [N]; returns W = q * s."""
    g = torch.Generator().manual_seed(seed)
    n, k = lin.weight.shape
    WeightOnlySlot.install(lin, LinearQuant("W8A16", 8))
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = 0.01 + 0.02 * torch.rand(n, generator=g)
    lin.weight = torch.nn.Parameter(q, requires_grad=False)
    lin.weights_scaling_factor = torch.nn.Parameter(s, requires_grad=False)
    return q.float() * s[:, None]


def _bf16_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within bf16 rounding of the compute (2^-8 relative), scaled by the output's magnitude."""
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_quantized_gated_mlp_runs_fc_and_gate_as_one_quantized_matmul(monkeypatch) -> None:
    """int8 fc and gate: after prepare, y = proj(silu(x Wf^T) * (x Wg^T)) with W = q * s, and the two run as
    one quantized matmul over their stacked rows, never apart (GatedMLP.fuse 4-6: the fused layer
    dropped; GatedMLP.forward 1-4: the fused layer not looked up)."""
    hid, inter = 32, 16  # whole int8 tiles: the layers can be fused
    mlp = _filled(GatedMLP(hid, inter, "silu", False, 0, 1, torch.float32), seed=8)
    mlp.fc.name, mlp.gate.name = "fc", "gate"
    w = {"fc.weight": _int8_linear(mlp.fc, 9), "gate.weight": _int8_linear(mlp.gate, 10),
         "proj.weight": mlp.proj.weight.detach().clone()}
    _prepare(mlp)
    called = []
    real = WeightOnlySlot.matmul

    def spy(self, linear, x, bias):
        called.append(linear)
        return real(self, linear, x, bias)

    monkeypatch.setattr(WeightOnlySlot, "matmul", spy)
    x = torch.randn(3, hid, generator=torch.Generator().manual_seed(11))
    _bf16_close(mlp(x), _gated_reference(x, w))
    assert mlp.fc not in called and mlp.gate not in called
    assert [lin.weight.shape[0] for lin in called] == [2 * inter]


def test_gated_mlp_with_only_fc_quantized_runs_each_layer_apart() -> None:
    """fc int8, gate left in float (a config that keeps some linears unquantized): fuse() cannot stack
    them and the output is still proj(silu(x Wf^T) * (x Wg^T)) (GatedMLP.fuse 1: the float fusion
    concatenating int8 codes with float weights)."""
    hid, inter = 32, 16
    mlp = _filled(GatedMLP(hid, inter, "silu", False, 0, 1, torch.float32), seed=12)
    mlp.fc.name = "fc"
    w = {"fc.weight": _int8_linear(mlp.fc, 13), "gate.weight": mlp.gate.weight.detach().clone(),
         "proj.weight": mlp.proj.weight.detach().clone()}
    _prepare(mlp)
    x = torch.randn(3, hid, generator=torch.Generator().manual_seed(14))
    _bf16_close(mlp(x), _gated_reference(x, w))


def test_plain_mlp_adds_lora_deltas_of_fc_and_proj() -> None:
    """MLP: y = proj(relu(fc(x))) with biases, fc's LoRA delta added before the activation and proj's to
    its output (MLP.forward 2, 4, 10, 12)."""
    mlp = _filled(MLP(H, INTER, "relu", True, 0, 1, torch.float32), seed=15)
    w = {k: v.clone() for k, v in mlp.state_dict().items()}
    for lora in (_Lora([mlp.fc, mlp.proj], seed=16), _Lora([mlp.fc], seed=17), _Lora([mlp.proj], seed=18)):
        x = torch.randn(4, H, generator=torch.Generator().manual_seed(19))
        named = _named_lora(mlp, lora)

        def lin(name, z, named=named):
            y = z @ w[name + ".weight"].t() + w[name + ".bias"]
            return y + named[name](z) if name in named else y

        torch.testing.assert_close(mlp(x, lora), lin("proj", _relu(lin("fc", x))), **FP32_TOL)


# --- cpu_matmul.py -------------------------------------------------------------------------------


def test_native_half_gemm_is_false_for_a_dtype_without_half_flags(monkeypatch) -> None:
    """native_half_gemm(float32) on a CPU with known flags (even bf16 / fp16 ones): False, not an error
    (cpu_matmul native_half_gemm 7, 9: NATIVE_FLAGS.get without its () default)."""
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16", "amx_fp16"}))
    assert cpu_matmul.native_half_gemm(torch.float32) is False
    assert cpu_matmul.native_half_gemm(torch.float16) is True


@pytest.mark.parametrize("rows", [1, 2])
def test_hold_transposed_small_column_major_slices(rows) -> None:
    """A column-major [N, K] slice of a fused transposed buffer: with N >= 2 rows it is kept as it is
    (returned W^T is the buffer's own memory), with N = 1 (stride(0) says nothing there) it is copied
    into a contiguous [K, 1] W^T; either way the parameter keeps its values and is a view of the
    returned W^T (cpu_matmul hold_transposed 9, 10: a 1-row slice left strided; 11: 2 rows copied)."""
    k = 6
    buf = torch.randn(k, 5, generator=torch.Generator().manual_seed(20))  # [K, 5]
    param = torch.nn.Parameter(buf.t()[:rows], requires_grad=False)  # [rows, K], stride(0) == 1
    values = param.detach().clone()
    wt = cpu_matmul.hold_transposed(param)
    assert wt.shape == (k, rows) and torch.equal(param, values) and param.data_ptr() == wt.data_ptr()
    if rows == 1:
        assert wt.is_contiguous() and wt.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    else:
        assert wt.data_ptr() == buf.data_ptr()


def test_matmul_t_keeps_leading_dims() -> None:
    """matmul_t on x [B, T, K] -> [B, T, N] = x W^T + b over the flattened rows (cpu_matmul matmul_t 8:
    rows flattened by dim 1; 48: the output viewed by dim 1)."""
    g = torch.Generator().manual_seed(21)
    x, w, b = torch.randn(2, 3, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    y = cpu_matmul.matmul_t(x, w.t().contiguous(), b)
    torch.testing.assert_close(y, torch.einsum("btk,nk->btn", x, w) + b, **FP32_TOL)


def _half_tol(dtype: torch.dtype) -> float:
    """A few units of the dtype's rounding (bf16 2^-8, fp16 2^-11), for outputs rounded once."""
    return 4 * torch.finfo(dtype).eps


def _compiled_kernels() -> bool:
    return dispatch.use_cpu_kernels(torch.zeros(1, 1, dtype=torch.bfloat16))


@pytest.mark.parametrize("tokens", [3, 40])
def test_matmul_t_bf16_on_a_strided_weight_equals_float32(tokens) -> None:
    """bf16 x @ wt where wt [K, N] is a strided column slice of a [K, 2N] buffer (a fused gate's fc half,
    as Linear.fuse holds it): the float32 product rounded to bf16, within bf16's tolerance; the compiled
    GEMV reads contiguous weights only (cpu_matmul matmul_t 10-13: a strided weight sent to it)."""
    g = torch.Generator().manual_seed(22)
    k, n = 64, 24
    buf = torch.randn(k, 2 * n, generator=g).to(torch.bfloat16)
    wt = buf[:, n:]
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    ref = x.float() @ wt.float()
    y = cpu_matmul.matmul_t(x, wt)
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, n)
    tol = _half_tol(torch.bfloat16)
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def _record_x_shapes(monkeypatch, owner, name: str) -> list[tuple[int, ...]]:
    """Wrap owner.name(x, wt) so that each call's x shape is appended to the returned list."""
    calls: list[tuple[int, ...]] = []
    real = getattr(owner, name)

    def spy(x, wt):
        calls.append(tuple(x.shape))
        return real(x, wt)

    monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.mark.parametrize("dtype,tokens,k,contiguous,compiled", [
    (torch.bfloat16, 1, 64, True, True),  # decode, K past KERNEL_MAX_TOKENS: compiled GEMV
    (torch.bfloat16, 32, 16, True, True),  # exactly KERNEL_MAX_TOKENS rows: still the GEMV
    (torch.bfloat16, 33, 16, True, False),  # one row more: torch
    (torch.bfloat16, 40, 16, True, False),
    (torch.bfloat16, 2, 16, False, False),  # strided weight: torch
    (torch.float32, 2, 16, True, False),  # float32 weights stay with torch (MKL)
], ids=["bf16-T1-K64", "bf16-T32", "bf16-T33", "bf16-T40", "bf16-strided", "fp32-T2"])
def test_matmul_t_runs_the_compiled_gemv_for_short_bf16_steps(dtype, tokens, k, contiguous, compiled,
                                                               monkeypatch) -> None:
    """The documented split: bf16 x and bf16 contiguous wt with at most KERNEL_MAX_TOKENS (32) rows run the
    compiled GEMV (core.kernels.cpu ops.linear_t), everything else torch; the result is the float32 product
    rounded once (cpu_matmul matmul_t 14-17: bf16 / same dtype / rows-not-K / <= bound of the split)."""
    if not _compiled_kernels():
        pytest.skip("the compiled CPU kernels are not built here (or BESTIARY_KERNELS is not auto)")
    calls = _record_x_shapes(monkeypatch, dispatch.cpu_ops(), "linear_t")
    g = torch.Generator().manual_seed(23)
    n = 24
    buf = torch.randn(k, 2 * n, generator=g).to(dtype)
    wt = buf[:, :n].contiguous() if contiguous else buf[:, :n]
    x = torch.randn(tokens, k, generator=g).to(dtype)
    ref = x.float() @ wt.float()
    y = cpu_matmul.matmul_t(x, wt)
    assert calls == ([(tokens, k)] if compiled else [])
    tol = _half_tol(dtype) if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


_NO_HALF_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma"})
_HALF_FLAGS = frozenset({"sse4_2", "avx2", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})


@pytest.mark.parametrize("dtype,tokens,native,upcast", [
    (torch.float16, 1, False, False),  # GEMV: half precision
    (torch.float16, 8, False, False),  # HALF_GEMV_MAX_TOKENS rows: still half
    (torch.float16, 9, False, True),  # GEMM without native fp16 dot products: fp32
    (torch.float16, 9, True, False),  # native fp16 (AMX): the half GEMM
    (torch.float32, 9, False, False),  # float32: no upcast to speak of
    (torch.float32, 9, True, False),
], ids=["fp16-T1", "fp16-T8", "fp16-T9", "fp16-T9-native", "fp32-T9", "fp32-T9-native"])
def test_matmul_t_upcasts_half_gemms_without_native_dot_products(dtype, tokens, native, upcast,
                                                                 monkeypatch) -> None:
    """Half-precision x with more than HALF_GEMV_MAX_TOKENS (8) rows runs upcast_matmul (fp32) unless the
    CPU flags say it has native half dot products; GEMVs, native CPUs and float32 run the plain matmul.
    Either way y = x W^T + b rounded once to x's dtype (cpu_matmul matmul_t 27-33; K = 16 > 8 tells rows
    from K)."""
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: _HALF_FLAGS if native else _NO_HALF_FLAGS)
    calls = _record_x_shapes(monkeypatch, cpu_matmul, "upcast_matmul")
    g = torch.Generator().manual_seed(24)
    k, n = 16, 10
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    y = cpu_matmul.matmul_t(x, w.t().contiguous(), b)
    assert calls == ([(tokens, k)] if upcast else [])
    ref = x.float() @ w.float().t() + b.float()
    assert y.dtype == dtype and y.shape == (tokens, n)
    tol = _half_tol(dtype) if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("native", [False, True], ids=["plain", "native"])
def test_dense_weight_matmul_rounds_the_weight_only_on_native_cpus(dtype, native, monkeypatch) -> None:
    """dense_weight_matmul(x, W) for a float32 W made on the fly: without native half dot products the
    GEMM runs in float32 (W not rounded, the output rounded once to x's dtype); with them it runs in
    x's dtype on W rounded to it. W = [1 + 2^-12, -1] on x = [1, 1] tells them apart: 2^-12 vs 0.
    Random data: the float32 product within the dtype's tolerance (cpu_matmul dense_weight_matmul 1-14)."""
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: _HALF_FLAGS if native else _NO_HALF_FLAGS)
    x = torch.ones(1, 2, dtype=dtype)
    w = torch.tensor([[1 + 2.0**-12, -1.0]])
    y = cpu_matmul.dense_weight_matmul(x, w)
    assert y.dtype == dtype and y.shape == (1, 1)
    assert y.item() == (0.0 if native else 2.0**-12)

    g = torch.Generator().manual_seed(25)
    x, w = torch.randn(5, 32, generator=g).to(dtype), torch.randn(7, 32, generator=g)
    y = cpu_matmul.dense_weight_matmul(x, w)
    ref = x.float() @ w.t()
    assert y.dtype == dtype and y.shape == (5, 7)
    tol = _half_tol(dtype) * (2 if native else 1)  # native: W rounded too
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_dense_weight_matmul_in_float32_casts_the_weight_to_x() -> None:
    """A float32 x with a bf16 W: y = x W^T in float32 (W cast to x's dtype, no error, no rounding of the
    output) (cpu_matmul dense_weight_matmul 10-14)."""
    g = torch.Generator().manual_seed(26)
    x, w = torch.randn(3, 16, generator=g), torch.randn(4, 16, generator=g).to(torch.bfloat16)
    y = cpu_matmul.dense_weight_matmul(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w.float().t(), **FP32_TOL)


def test_heap_chunks_keep_each_piece_under_glibcs_mmap_threshold():
    """A long prefill's [T, 2I] activation comes in pieces under 32 MiB (glibc maps larger blocks afresh
    each time: every layer faulted them in again): SmolLM2's 2I = 3072 at 8,192 tokens is 48 MiB in
    bfloat16 (2 pieces) and 96 MiB in float32 (3 MiB over 3 x 32: 4 pieces); off the CPU, one."""
    from bestiary.core.layers.mlp import heap_chunks

    assert heap_chunks(torch.empty(8192, 576, dtype=torch.bfloat16), 3072) == 2
    assert heap_chunks(torch.empty(8192, 576), 3072) == 4
    assert heap_chunks(torch.empty(5460, 576, dtype=torch.bfloat16), 3072) == 1  # 32 MiB less 10 KiB
    assert heap_chunks(torch.empty(5461, 576, dtype=torch.bfloat16), 3072) == 2  # within 4 KiB of it
    assert heap_chunks(torch.empty(1, 576), 3072) == 1
    assert heap_chunks(torch.empty(8192, 576, device="meta"), 3072) == 1


@pytest.mark.parametrize("lora", [False, True])
def test_gated_mlp_in_heap_pieces_gives_the_whole_output(monkeypatch, lora):
    """With the threshold at 1 KiB, 40 tokens of 2I = 24 floats (96 bytes a row) run in 4 pieces of 10
    rows (the fused matmul and proj see at most 10), and the output is the one-piece forward's; a step with a
    LoRA delta (per-token adapters) runs whole."""
    from bestiary.core.kernels.cpu import malloc

    mlp = _filled(GatedMLP(H, INTER, "silu", False, 0, 1, torch.float32), 3)
    _prepare(mlp)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4))
    delta = _Lora({mlp.fc: None}, 5) if lora else None
    whole = mlp(x, delta)
    rows = []
    real = cpu_matmul.matmul_t if mlp._fused_t is not None else cpu_matmul.matmul_tiled
    spy = lambda a, *args, **kw: rows.append(a.shape[0]) or real(a, *args, **kw)  # noqa: E731
    monkeypatch.setattr(cpu_matmul, real.__name__, spy)
    monkeypatch.setattr(malloc, "MMAP_BYTES", 4096 + 1024)
    pieces = mlp(x, delta)
    assert rows == ([40, 40] if lora else [10, 10] * 4)  # fc|gate, then proj, per piece
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)
    ref_g = x @ mlp.fc.weight.t()
    ref = (_silu(ref_g) * (x @ mlp.gate.weight.t()) if not lora else None)
    if ref is not None:
        torch.testing.assert_close(pieces, ref @ mlp.proj.weight.t(), **FP32_TOL)
