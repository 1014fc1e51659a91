"""Kernel-family contracts that `make mutation` (tests/mutation_run.py kernels) found untested.

Here, not in tests/, because the kernel modules must be imported under this folder's conftest
(TRITON_INTERPRET=1). Each test names the mutants of core/kernels/ it kills; the references
are the math written out in the test, not the module's own `_ref` functions.
"""

from __future__ import annotations

import pytest
import torch

from bestiary.core.kernels import dispatch

norms = dispatch.family("norms")
woq = dispatch.family("woq_gemm")
moe = dispatch.family("moe")
sampling = dispatch.family("sampling")


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_rms_norm_ref_is_the_formula(x_dtype, w_dtype) -> None:
    """rms_norm_ref(x, w, eps) = x / sqrt(mean(x^2) + eps) * w in float32, cast to x's dtype, for
    each branch: F.rms_norm (float32; half x with a weight of its dtype) and the written-out
    float32 math (half x, float32 weight), which no CPU test reached (rms_norm_ref 18-33). Rows
    of mean(x^2) ~ 0.04, 1 and 9 next to eps = 0.5: a dropped eps (11, 15), x^3 (28) or a mean
    over the wrong dims (23, 30) shows."""
    torch.manual_seed(0)
    x = (torch.randn(3, 40) * torch.tensor([[0.2], [1.0], [3.0]])).to(x_dtype)
    w = (torch.rand(40) + 0.5).to(w_dtype)
    xf = x.float()
    want = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 0.5) * w.float()).to(x_dtype)
    got = norms.rms_norm_ref(x, w, 0.5)
    assert got.dtype == x_dtype
    tol = 1e-6 if x_dtype == torch.float32 else 1e-2  # bf16: one rounding of a value < 2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm_ref_is_the_formula(bias) -> None:
    """layer_norm_ref = (x - mean) / sqrt(var + eps) * w + b in float32, cast back; eps = 0.5 and a
    bf16 input (the float32 promotion matters)."""
    torch.manual_seed(1)
    x = (torch.randn(4, 24) / 10 + 0.3).to(torch.bfloat16)
    w, b = torch.rand(24) + 0.5, (torch.randn(24) if bias else None)
    xf = x.float()
    mean, var = xf.mean(-1, keepdim=True), xf.var(-1, unbiased=False, keepdim=True)
    want = (xf - mean) / torch.sqrt(var + 0.5) * w + (b if bias else 0.0)
    got = norms.layer_norm_ref(x, w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16), 0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_woq_int8_ref_in_bf16() -> None:
    """woq_int8_linear_ref with bf16 x and float32 scales: x (q s)^T (+ b) to bf16 accuracy
    (woq_int8_linear_ref 20: the scales left in float32 for aten's bf16 int8 matmul)."""
    torch.manual_seed(2)
    x = torch.randn(5, 64).to(torch.bfloat16)
    q = torch.randint(-128, 128, (33, 64), dtype=torch.int8)
    s = torch.rand(33) / 100 + 1e-3
    want = x.float() @ (q.float() * s[:, None]).t()
    got = woq.woq_int8_linear_ref(x, q, s)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """The values of t [R, C] in a non-contiguous layout: 'step' has stride(-1) == 2, 'transposed'
    stride(-2) == 1."""
    if how == "step":
        wide = t.new_zeros(t.shape[0], 2 * t.shape[1])
        wide[:, ::2] = t
        return wide[:, ::2]
    return t.t().contiguous().t()


@pytest.mark.parametrize("how", ["step", "transposed"])
def test_launchers_take_non_contiguous_inputs(how, device) -> None:
    """Launchers on inputs whose last dim is not contiguous equal their results on contiguous
    copies: moe_route 5, 8-10, woq_int8_linear 13, 16-18, woq_int4_linear 28, 31-33, the norms'
    _rows 11, 14-16, sampling's filter_logits 3, 6-8 (the kernel then reads a strided tensor as
    if it were dense)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 8, device=device)
    w_ref, e_ref = moe.moe_route(logits, 2)
    w, e = moe.moe_route(strided(logits, how), 2)
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(w, w_ref)
    x = torch.randn(4, 64, device=device)
    q = torch.randint(-128, 128, (32, 64), dtype=torch.int8, device=device)
    s = torch.rand(32, device=device) / 100 + 1e-3
    want = woq.woq_int8_linear(x, q, s, None, block_k=32)
    got = woq.woq_int8_linear(strided(x, how), q, s, None, block_k=32)
    torch.testing.assert_close(got, want)
    q4 = woq.pack_int4(torch.randint(0, 16, (32, 64))).to(device)  # [N, K / 2], one group of 64
    s4 = torch.rand(32, 1, device=device) / 20 + 0.01
    want = woq.woq_int4_linear(x, q4, s4, None, 64, block_k=32)
    torch.testing.assert_close(woq.woq_int4_linear(strided(x, how), q4, s4, None, 64, block_k=32), want)
    w = torch.rand(64, device=device) + 0.5
    torch.testing.assert_close(norms.rms_norm(strided(x, how), w, 1e-5), norms.rms_norm(x, w, 1e-5))
    top_k = torch.tensor([3, 0, 0, 5], device=device)
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9], device=device)
    want = sampling.filter_logits(x, top_k, top_p)
    assert torch.equal(sampling.filter_logits(strided(x, how), top_k, top_p), want)


def _dense_biased(q, meta, seq_lens, ctx_lens, k_pool, v_pool, scale, slopes, key_bias, windows, sinks):
    """softmax_j(scale * q_i . k_j + slope_h * (j - i) + key_bias[h, j]) v_j over the keys that
    j <= i and (no window or j < sink or i - j < window - sink) admit, written out per sequence
    from the pools' slots: q [T, H, D] -> [T, H * D] float32."""
    from kernel_helpers import sequence_kv

    h, outs, start = q.shape[1], [], 0
    for b, (n, ctx) in enumerate(zip(seq_lens, ctx_lens)):
        pos, kk, vv = sequence_kv(meta, k_pool, v_pool, b, ctx + n, h)  # [L], [L, H, D] x 2
        qpos = (ctx + torch.arange(n))[:, None]  # [n, 1]
        w, s = windows[b], sinks[b]
        seen = (pos[None] <= qpos) & ((w == 0) | (pos[None] < s) | (qpos - pos[None] < w - s))  # [n, L]
        scores = torch.einsum("nhd,lhd->hnl", q[start : start + n].cpu().float(), kk) * scale
        scores = scores + slopes.cpu()[:, None, None] * (pos[None, None] - qpos[None]).float()
        scores = scores + key_bias(pos).cpu()[:, None, :]
        probs = scores.masked_fill(~seen[None], float("-inf")).softmax(-1)
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vv).reshape(n, -1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("decode", [False, True])
def test_paged_attention_entry_points_pass_scale_alibi_and_key_bias(decode, windowed, device) -> None:
    """`paged_attention` (the launcher the layers call) and `paged_attention_ref` hand scale, ALiBi
    slopes and the key bias to each of their branches (decode / prefill / windowed): both match the
    biased dense attention written out above, at a scale that is not 1/sqrt(D) (a dropped scale
    falls back to it). Kills paged_attention 23, 24, 31, 32, 39, 40, 47, 48 and paged_attention_ref
    8-10, 41, which no test reached: the bias tests call `decode` / `prefill` directly and the
    windowed ones pass no bias."""
    from kernel_helpers import assert_close, paged_inputs

    from bestiary.core.layers.attention import alibi_slopes

    attention = dispatch.family("attention")
    torch.manual_seed(3)
    seq, ctx = ([1, 1, 1], [4, 11, 17]) if decode else ([6, 3, 9], [0, 8, 12])
    h, kvh, d, scale = 4, 2, 16, 0.37
    q, k, v, meta, kp, vp = paged_inputs(seq, ctx, h, kvh, d, torch.float32, device)
    windows, sinks = ([5, 0, 7], [2, 0, 0]) if windowed else ([0] * 3, [0] * 3)
    if windowed:
        meta.windows, meta.sinks = windows, sinks
    bounds = meta.window_bounds(0)
    assert (bounds is not None) == windowed
    slopes = alibi_slopes(h).to(device) * 4  # steep enough to move the output well past tolerance
    tilt = torch.linspace(-2.0, 2.0, h, device=device)

    def key_bias(k_pos: torch.Tensor) -> torch.Tensor:  # [L] -> [H, L]: a per-head tilt over positions
        return tilt[:, None] * torch.cos(k_pos[None, :].float())

    want = _dense_biased(q, meta, seq, ctx, kp, vp, scale, slopes, key_bias, windows, sinks)
    for slopes_in, kb_in in ((slopes, None), (None, key_bias)):  # each bias must matter on its own
        plain = _dense_biased(q, meta, seq, ctx, kp, vp, scale, slopes_in if slopes_in is not None else torch.zeros(h),
                              kb_in or (lambda p: torch.zeros(h, p.numel())), windows, sinks)
        assert (plain - want).abs().max() > 0.05
    ref = attention.paged_attention_ref(q, k, v, meta, kp, vp, scale, slopes, key_bias, bounds)
    assert_close(ref.cpu(), want, torch.float32)
    out = attention.paged_attention(q, k, v, meta, kp, vp, scale, slopes, key_bias, bounds)
    assert_close(out.cpu(), want, torch.float32)


def test_moe_route_renormalizes_by_default(device) -> None:
    """Mixtral's rule is the default: the top-k softmax weights sum to 1 per token without an
    argument (moe_route_ref 1 made the default False; the tests always passed it)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 8, device=device)
    for route in (moe.moe_route_ref, moe.moe_route):
        weights, experts = route(logits, 2)
        top = torch.softmax(logits.float(), -1).topk(2, -1)
        assert torch.equal(experts.sort(-1).values.cpu(), top.indices.sort(-1).values.cpu())
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(5), rtol=1e-5, atol=1e-5)


def _step(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose last stride is 2 (any rank)."""
    wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., ::2] = t
    return wide[..., ::2]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose second-to-last stride is 1 (the last two dims swapped in memory)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_more_launchers_guard_their_strides(device) -> None:
    """grouped_gemm and lora_sgmv copy an input whose last dim is strided or transposed (equal to
    contiguous); the activation, rotary and attention launchers refuse one with a ValueError whose
    whole text is checked (their kernels read rows as dense): kills the `stride(-2)` checks of
    grouped_gemm 21 and lora_sgmv, paged_attention 1, 2, and the message mutants rotary._launch 21,
    activations._launch 33 (other stride mutants are equivalent: `and False` only copies,
    `stride(+1)` is `stride(-1)` on 2-D inputs)."""
    torch.manual_seed(5)
    a = torch.randn(6, 40, device=device)
    w = torch.randn(3, 24, 40, device=device) / 40**0.5
    experts = torch.randint(0, 3, (6, 2), device=device)
    want = moe.grouped_gemm(a, w, experts, 2, None, block_m=16, block_n=32, block_k=32)
    for a_in, w_in in ((_step(a), w), (a, _step(w)), (_transposed(a), w), (a, _transposed(w))):
        torch.testing.assert_close(moe.grouped_gemm(a_in, w_in, experts, 2, None, block_m=16, block_n=32, block_k=32),
                                   want)
    lora = dispatch.family("lora")
    x = torch.randn(5, 32, device=device)
    la, lb = torch.randn(2, 4, 32, device=device), torch.randn(2, 48, 4, device=device)
    args = (torch.tensor([0, 2, 5], dtype=torch.int32, device=device), torch.tensor([1, 0], dtype=torch.int32, device=device),
            torch.tensor([4, 3], dtype=torch.int32, device=device), torch.tensor([0.5, 2.0], device=device))
    want = lora.lora_sgmv(x, la, lb, *args, block_n=32, block_k=32)
    for view in (_step, _transposed):
        for inputs in ((view(x), la, lb), (x, view(la), lb), (x, la, view(lb))):
            torch.testing.assert_close(lora.lora_sgmv(*inputs, *args, block_n=32, block_k=32), want)

    acts = dispatch.family("activations")
    f, g = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    refused = "^activation kernel: inputs need a unit last stride$"  # the whole message: a user reads it
    for bad in ((_step(f), g), (f, _step(g))):
        with pytest.raises(ValueError, match=refused):
            acts.act_and_mul(*bad, "silu")
    with pytest.raises(ValueError, match=refused):
        acts.activation(_step(f), "gelu")
    fused = torch.randn(4, 32, device=device)  # the two halves of a fused [T, 2I]: rows apart, unit last stride
    torch.testing.assert_close(acts.act_and_mul(fused[:, :16], fused[:, 16:], "silu"),
                               acts.act_and_mul_ref(fused[:, :16], fused[:, 16:], "silu"))

    rot = dispatch.family("rotary")
    xr, cos, sin = torch.randn(3, 2, 8, device=device), torch.rand(3, 1, 4, device=device), torch.rand(3, 1, 4, device=device)
    for bad in ((_step(xr), cos, sin), (xr, _step(cos), sin), (xr, cos, _step(sin))):
        with pytest.raises(ValueError, match="^rotary kernel: x, cos and sin need a unit last stride$"):
            rot.apply_rotary(*bad, 8, "neox")

    from kernel_helpers import paged_inputs

    attention = dispatch.family("attention")
    q, k, v, meta, kp, vp = paged_inputs([1, 1], [3, 6], 2, 1, 16, torch.float32, device)
    for bad in ((_step(q.contiguous()), kp, vp), (q, _step(kp), _step(vp)), (q, kp, _step(vp))):
        with pytest.raises(ValueError, match="^attention kernel: q and the pools need a unit last stride, K and V "
                                             "pools one layout$"):
            attention.paged_attention(bad[0], k, v, meta, bad[1], bad[2], 0.25, None)
