"""core/layers attention contracts that `make mutation` (tests/mutation_run.py layers_attention) found untested.

Each attention path is checked against a dense reference written here (one query at a time,
explicit mask), on cases the model parity tests never build: a continuation after exactly one
cached token, non-default scales, ALiBi with a non-power-of-two head count, a key bias under a
window, prefix-LM under a window, a block size smaller than the kv head count, and metadata made
without `build`. The decoder layers are checked on stub modules against their formulas.
"""

from __future__ import annotations

import pytest
import torch
from test_zoo_remote import get_interleave  # the ALiBi paper's get_slopes, as Baichuan ships it
from torch import nn

from bestiary.core.kernels import attention_ref as R
from bestiary.core.kernels import dispatch
from bestiary.core.kernels import metadata as M
from bestiary.core.kernels.attention_window import FULL
from bestiary.core.kernels.cpu import build as cpu_build
from bestiary.core.layers import attention as A
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer, add_and_norm
from bestiary.core.layers.output_norm_decoder_layer import OutputNormDecoderLayer
from bestiary.core.layers.parallel_decoder_layer import ParallelDecoderLayer
from bestiary.core.layers.post_norm_decoder_layer import PostNormDecoderLayer
from bestiary.core.layers.self_attention import SelfAttention, kv_heads_of_rank

BLOCK = 4


def dense_reference(q, keys, values, q_pos, k_pos, scale, slopes=None, key_bias=None, prefix=0, window=FULL,
                    sinks=0):
    """out[i] = softmax_j(q_i . k_j * scale + slope_h (k_j - q_i) + key_bias_h(k_j)) v_j over the keys query i
    sees: j <= i or j < prefix, and, under a window, j < sinks or i - j < window - sinks. One query at a time,
    float64. q [n, H, D], keys / values [K, KVH, D] at positions k_pos -> [n, H * D]."""
    n, h, d = q.shape
    rep = h // keys.shape[1]
    k = keys.double().repeat_interleave(rep, 1)  # [K, H, D]
    v = values.double().repeat_interleave(rep, 1)
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for i in range(n):
        qi = int(q_pos[i])
        for head in range(h):
            s = (k[:, head] @ q[i, head].double()) * scale  # [K]
            if slopes is not None:
                s = s + float(slopes[head]) * (k_pos.double() - qi)
            if key_bias is not None:
                s = s + key_bias(k_pos)[head].double()
            seen = (k_pos <= qi) | (k_pos < prefix)
            if window != FULL:
                seen = seen & ((k_pos < sinks) | (qi - k_pos < window - sinks))
            s = s.masked_fill(~seen, float("-inf"))
            out[i, head] = torch.softmax(s, 0) @ v[:, head]
    return out.reshape(n, h * d)


def fill_pool(lens, tables, kvh, d, dtype, seed=0):
    """Pools [12, BLOCK, KVH, D] holding each sequence's keys / values at its table, NaN elsewhere,
    and the keys / values in position order."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.full((12, BLOCK, kvh, d), float("nan"), dtype=dtype)
    v_pool = torch.full((12, BLOCK, kvh, d), float("nan"), dtype=dtype)
    ks, vs = [], []
    for length, table in zip(lens, tables):
        k = torch.randn(length, kvh, d, generator=g).to(dtype)
        v = torch.randn(length, kvh, d, generator=g).to(dtype)
        for j in range(length):
            k_pool[table[j // BLOCK], j % BLOCK] = k[j]
            v_pool[table[j // BLOCK], j % BLOCK] = v[j]
        ks.append(k)
        vs.append(v)
    return k_pool, v_pool, ks, vs


def key_bias_fn(h):
    """A per-head bias of key positions that no rotation of the scores undoes."""
    return lambda k_pos: torch.sin(k_pos.float()[None, :] * 0.7 + torch.arange(h, dtype=torch.float32)[:, None])


def prefill_case(seq_lens, ctx_lens, tables, h=6, kvh=2, d=8, dtype=torch.float32, seed=0, build=True, **meta_kw):
    """q / k / v of a packed step (this step's k / v are also in the pools, as PagedAttention writes them
    before it attends), the metadata, and each sequence's keys / values in position order."""
    lens = [c + n for c, n in zip(ctx_lens, seq_lens)]
    k_pool, v_pool, ks, vs = fill_pool(lens, tables, kvh, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(seq_lens), h, d, generator=g).to(dtype)
    k = torch.cat([kk[c:] for kk, c in zip(ks, ctx_lens)])
    v = torch.cat([vv[c:] for vv, c in zip(vs, ctx_lens)])
    if build:
        meta = M.AttentionMetadata.build(seq_lens, ctx_lens, tables, BLOCK, **meta_kw)
    else:  # made by hand: no contiguous_from
        padded = [t + [0] * (max(map(len, tables)) - len(t)) for t in tables]
        meta = M.AttentionMetadata(positions=torch.zeros(sum(seq_lens), dtype=torch.int64), seq_lens=seq_lens,
                                   context_lens=ctx_lens, block_tables=torch.tensor(padded),
                                   slot_mapping=torch.zeros(sum(seq_lens), dtype=torch.int64), block_size=BLOCK,
                                   **meta_kw)
    return q, k, v, meta, k_pool, v_pool, ks, vs


def expected(q, meta, ks, vs, scale, **kw):
    """dense_reference per sequence of a packed step."""
    outs, start = [], 0
    for i, (n, c) in enumerate(zip(meta.seq_lens, meta.context_lens)):
        prefix = meta.prefix_lens[i] if meta.prefix_lens and meta.mask == "prefix_lm" else 0
        outs.append(dense_reference(q[start : start + n], ks[i], vs[i], torch.arange(c, c + n),
                                    torch.arange(c + n), scale, prefix=prefix, **kw))
        start += n
    return torch.cat(outs)


# seq_lens, context_lens, tables: one cached token; a fresh prompt; a split table
STEP = ([3, 5, 2], [1, 0, 6], [[2, 3], [4, 5], [9, 1]])


@pytest.mark.parametrize("bias", ["none", "alibi", "key_bias"])
@pytest.mark.parametrize("build", [True, False])
def test_prefill_attention_equals_dense_reference(bias, build):
    h = 6  # not a power of two: the slopes' interleaved tail
    q, k, v, meta, k_pool, v_pool, ks, vs = prefill_case(*STEP, h=h, build=build)
    slopes = A.alibi_slopes(h) if bias == "alibi" else None
    kb = key_bias_fn(h) if bias == "key_bias" else None
    out = R.prefill_attention(q, k, v, meta, k_pool, v_pool, 0.3, slopes, kb)
    ref = expected(q, meta, ks, vs, 0.3, slopes=slopes, key_bias=kb)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_prefill_attention_prefix_lm_and_bf16_bias():
    q, k, v, meta, k_pool, v_pool, ks, vs = prefill_case([4, 3], [0, 2], [[0, 1], [5, 6]], mask="prefix_lm",
                                                          prefix_lens=[3, 4])
    out = R.prefill_attention(q, k, v, meta, k_pool, v_pool, 0.3, None)
    torch.testing.assert_close(out.double(), expected(q, meta, ks, vs, 0.3), rtol=1e-5, atol=1e-5)
    # bf16 with ALiBi: the bias is handed to SDPA in the query's dtype
    q, k, v, meta, k_pool, v_pool, ks, vs = prefill_case(*STEP, dtype=torch.bfloat16)
    slopes = A.alibi_slopes(6)
    out = R.prefill_attention(q, k, v, meta, k_pool, v_pool, 0.3, slopes)
    assert out.dtype == torch.bfloat16
    ref = expected(q, meta, ks, vs, 0.3, slopes=slopes)
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("window,sinks,mask", [(3, 0, "causal"), (5, 2, "causal"), (64, 0, "prefix_lm"),
                                               (4, 1, "prefix_lm"), (4, 1, "causal_with_prefix_lens")])
@pytest.mark.parametrize("bias", ["alibi", "key_bias"])
def test_windowed_attention_equals_dense_reference(window, sinks, mask, bias):
    """(A causal mask ignores prefix lengths, when a step has them.)"""
    h = 6
    kw = {"mask": mask.split("_with")[0], "prefix_lens": [2, 3, 4]} if mask != "causal" else {}
    q, k, v, meta, k_pool, v_pool, ks, vs = prefill_case(*STEP, h=h, **kw)
    slopes = A.alibi_slopes(h) if bias == "alibi" else None
    kb = key_bias_fn(h) if bias == "key_bias" else None
    out = R.windowed_attention(q, k, v, meta, k_pool, v_pool, 0.3, slopes, kb, [window] * 3, [sinks] * 3)
    ref = expected(q, meta, ks, vs, 0.3, slopes=slopes, key_bias=kb, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_alibi_slopes_equal_the_papers():
    for n in (1, 2, 4, 5, 6, 8, 12, 20, 32):
        torch.testing.assert_close(A.alibi_slopes(n), torch.tensor(get_interleave(n), dtype=torch.float32))


def test_decode_padded_with_key_bias_equals_per_sequence():
    """The padded batch (non-CPU devices) agrees with the per-sequence path under a key bias, for two
    sequences of different lengths over NaN garbage."""
    h, lens, tables = 6, [6, 3], [[1, 2], [7]]
    k_pool, v_pool, ks, vs = fill_pool(lens, tables, 2, 8, torch.float32)
    meta = M.AttentionMetadata.build([1, 1], [n - 1 for n in lens], tables, BLOCK)
    q = torch.randn(2, h, 8, generator=torch.Generator().manual_seed(3))
    kb = key_bias_fn(h)
    out = R.decode_attention(q, meta, k_pool, v_pool, 0.3, None, kb)
    ref = torch.cat([dense_reference(q[i : i + 1], ks[i], vs[i], torch.tensor([n - 1]), torch.arange(n), 0.3,
                                     key_bias=kb) for i, n in enumerate(lens)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(R._decode_padded(q, meta, k_pool, v_pool, 0.3, None, kb), out, rtol=1e-5, atol=1e-5)
    assert meta.decode_padding(6, q.device).tolist() == [[False] * 6, [False] * 3 + [True] * 3]


def test_gather_kv_when_the_block_is_smaller_than_the_kv_heads():
    pool = torch.arange(6 * 2 * 4 * 1, dtype=torch.float32).view(6, 2, 4, 1)  # [blocks, block 2, KVH 4, D 1]
    table = torch.tensor([[4, 1, 3]])
    got = R._gather_kv(pool, table, 5)
    torch.testing.assert_close(got, torch.cat([pool[4], pool[1], pool[3]])[None, :5])
    view = R._gather_kv(pool, torch.tensor([[2, 3, 4]]), 5, start=2)
    assert view.data_ptr() == pool[2].data_ptr()
    torch.testing.assert_close(view, torch.cat([pool[2], pool[3], pool[4]])[None, :5])


def test_contiguous_start():
    assert M._contiguous_start([], 0) is None and M._contiguous_start([], 2) is None
    assert M._contiguous_start([5, 6], 0) is None
    assert M._contiguous_start([5], 1) == 5
    assert M._contiguous_start([5, 6, 9], 2) == 5
    assert M._contiguous_start([5, 6, 9], 3) is None
    assert M._contiguous_start([0, 1, 2], 3) == 0
    assert M._contiguous_start([3, 2], 2) is None


def test_window_bounds_per_layer_window_and_none_without_windows():
    meta = M.AttentionMetadata.build([1, 1], [4, 9], [[0, 1], [2, 3, 4]], BLOCK)
    assert meta.window_bounds(FULL) is None
    assert meta.window_bounds(4) == ([4, 4], [0, 0])
    assert meta.window_bounds(6) == ([6, 6], [0, 0])  # a second layer window in the same step
    meta = M.AttentionMetadata.build([1, 1], [4, 9], [[0, 1], [2, 3, 4]], BLOCK, windows=[FULL, FULL], sinks=[0, 0])
    assert meta.window_bounds(FULL) is None  # windows given, none of them set
    meta = M.AttentionMetadata.build([1, 1], [4, 9], [[0, 1], [2, 3, 4]], BLOCK, windows=[5, FULL], sinks=[2, 0])
    assert meta.window_bounds(FULL) == ([5, FULL], [2, 0])


def test_write_kv_quantizes_k_and_v_with_their_own_scales():
    from bestiary.core.kernels.kv_codes import quantize_kv

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g) * 4
    scales = torch.tensor([0.02, 0.05])
    for dtype in (torch.int8, torch.float8_e4m3fn):
        k_pool, v_pool = torch.zeros(4, BLOCK, 2, 8, dtype=dtype), torch.zeros(4, BLOCK, 2, 8, dtype=dtype)
        slots = torch.tensor([5, 0, 13])
        R.write_kv(k_pool, v_pool, k, v, slots, scales)
        flat_k, flat_v = k_pool.view(-1, 2, 8), v_pool.view(-1, 2, 8)
        assert torch.equal(flat_k[slots].view(torch.uint8), quantize_kv(k, scales[0], dtype).view(torch.uint8))
        assert torch.equal(flat_v[slots].view(torch.uint8), quantize_kv(v, scales[1], dtype).view(torch.uint8))
        assert flat_k[1].float().abs().sum() == 0  # untouched slots stay
    k_pool, v_pool = torch.zeros(4, BLOCK, 2, 8, dtype=torch.bfloat16), torch.zeros(4, BLOCK, 2, 8, dtype=torch.bfloat16)
    R.write_kv(k_pool, v_pool, k, v, torch.tensor([1, 2, 3]))
    assert torch.equal(k_pool.view(-1, 2, 8)[1:4], k.bfloat16()) and torch.equal(v_pool.view(-1, 2, 8)[1:4], v.bfloat16())


def test_bf16_prefill_takes_the_compiled_kernel(monkeypatch):
    """head_dim 32 in bfloat16: prefill_attention hands each causal sequence (fresh or after cached tokens) to
    the compiled kernel, and its output equals the dense reference."""
    if cpu_build.isa_name(cpu_build.library()) == "scalar":
        pytest.skip("the compiled prefill attention needs a vector build")
    ops = dispatch.cpu_ops()
    calls = []
    real = ops.prefill_attention
    monkeypatch.setattr(ops, "prefill_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    q, k, v, meta, k_pool, v_pool, ks, vs = prefill_case(*STEP, h=4, kvh=2, d=32,
                                                          dtype=torch.bfloat16)
    assert R.compiled_prefill(q, ks[0], vs[0]) and not R.compiled_prefill(q.float(), ks[0].float(), vs[0].float())
    out = R.prefill_attention(q, k, v, meta, k_pool, v_pool, 0.3, None)
    assert calls == [(3, 4, 32), (5, 4, 32), (2, 4, 32)]
    torch.testing.assert_close(out.double(), expected(q, meta, ks, vs, 0.3), rtol=3e-2, atol=3e-2)


class Tagged(nn.Module):
    """A stub sublayer: x -> x * factor + offset, recording the LoRA argument it was given."""

    def __init__(self, factor: float, offset: float = 0.0):
        super().__init__()
        self.factor, self.offset, self.seen = factor, offset, []

    def forward(self, x, *args):
        self.seen.append(args[0] if len(args) == 1 else "attention")
        return x * self.factor + self.offset


class Norm(nn.Module):
    """A norm without a fused add_and_norm: x -> x / 2 + 1."""

    def forward(self, x):
        return x / 2 + 1


# each layer built from (norm, attention, mlp) stubs, and its output as a formula of x and the norm
DECODER_LAYERS = {
    "pre_norm": (lambda n, a, m: PreNormDecoderLayer(n, a, n, m), lambda n, x: (h := x + n(x) * 3) + n(h) * 5 + 1),
    "post_norm": (lambda n, a, m: PostNormDecoderLayer(n, a, n, m), lambda n, x: n((h := n(x + x * 3)) + h * 5 + 1)),
    "output_norm": (lambda n, a, m: OutputNormDecoderLayer(a, n, m, n), lambda n, x: (h := x + n(x * 3)) + n(h * 5 + 1)),
    "parallel": (lambda n, a, m: ParallelDecoderLayer(n, a, m), lambda n, x: x + n(x) * 3 + n(x) * 5 + 1),
}


@pytest.mark.parametrize("kind", list(DECODER_LAYERS))
def test_decoder_layers_compose_as_their_formulas(kind):
    """attention x -> 3 x, mlp x -> 5 x + 1 (handed the step's LoRA), norm x -> x / 2 + 1."""
    build, formula = DECODER_LAYERS[kind]
    x, meta, lora = torch.randn(3, 4), M.AttentionMetadata.build([3], [0], [[0]], BLOCK), object()
    meta.lora = lora
    norm, mlp = Norm(), Tagged(5.0, 1.0)
    out = build(norm, Tagged(3.0), mlp)(x, meta, None, None)
    torch.testing.assert_close(out, formula(norm, x))
    assert mlp.seen == [lora]


def test_add_and_norm_fused_and_plain():
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    y, h = add_and_norm(Norm(), x, r)  # no fused kernel: the add, then the norm
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, (x + r) / 2 + 1)
    fused = Norm()
    fused.add_and_norm = lambda a, b: ("fused", a, b)
    assert add_and_norm(fused, x, r)[0] == "fused"


def test_self_attention_passes_lora_and_holds_its_dtype():
    sa = SelfAttention(16, 4, 2, 4, dtype=torch.bfloat16)
    assert {p.dtype for p in sa.parameters()} == {torch.bfloat16}
    seen = []
    for lin in (sa.qkv, sa.dense):
        forward = lin.forward
        lin.forward = lambda x, lora=None, _f=forward: seen.append(lora) or _f(x)
    meta = M.AttentionMetadata.build([2], [0], [[0]], BLOCK)
    meta.lora = lora = object()
    pools = torch.zeros(2, BLOCK, 2, 4, dtype=torch.bfloat16), torch.zeros(2, BLOCK, 2, 4, dtype=torch.bfloat16)
    out = sa(torch.randn(2, 16, dtype=torch.bfloat16), meta, *pools)
    assert out.shape == (2, 16) and seen == [lora, lora]
    ranked = SelfAttention(16, 4, 2, 4, tp_rank=1, tp_size=2)
    assert (ranked.qkv.tp_rank, ranked.qkv.tp_size, ranked.dense.tp_rank, ranked.dense.tp_size) == (1, 2, 1, 2)
    assert sa.qkv.tp_rank == 0 and sa.qkv.tp_size == 1


def test_kv_heads_of_rank_refuses_with_the_numbers():
    assert kv_heads_of_rank(8, 4, 2, 1) == range(2, 4)
    assert kv_heads_of_rank(8, 2, 4, 3) == range(1, 2)
    with pytest.raises(ValueError, match="tp_size 3 must divide num_key_value_heads 2 or be a multiple of it"):
        kv_heads_of_rank(6, 2, 3, 0)
    with pytest.raises(ValueError, match="tp_size 4 must divide num_attention_heads 6"):
        kv_heads_of_rank(6, 2, 4, 0)


def test_a_bf16_standard_layer_model_holds_every_tensor_in_bf16(tmp_path):
    """Qwen2 builds its layers with standard_layer: attention, norms and MLP take the model's dtype."""
    import parity
    import transformers

    config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    src = parity.save_hf(transformers.Qwen2ForCausalLM(config), tmp_path)
    model = parity.convert_and_load(src, tmp_path, dtype="bfloat16").model
    layer = model.transformer.layers[0]
    assert type(layer).__name__ == "PreNormDecoderLayer"
    dtypes = {name: t.dtype for name, t in model.state_dict().items() if t.is_floating_point()}
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes


@pytest.mark.parametrize("algo", ["INT8", "FP8"])
@pytest.mark.parametrize("bias", ["none", "key_bias"])
def test_paged_attention_on_quantized_pools_equals_the_dequantized_reference(algo, bias):
    """A prompt, then two decode steps, run eagerly through PagedAttention on INT8 / FP8 pools (the
    compiled decode reads the codes with the layer's scales; with a key bias the steps attend over
    dequantized blocks): each output equals attention over the dequantized keys and values."""
    from bestiary.core.kernels.kv_codes import KV_DTYPES, dequantize_kv, quantize_kv
    from bestiary.core.quant.kv import KVQuant

    h, kvh, d, n = 4, 2, 8, 5
    owner = nn.Module()
    owner.kv_cache_scaling_factor = nn.Parameter(torch.tensor([0.03, 0.05]), requires_grad=False)
    kb = key_bias_fn(h) if bias == "key_bias" else None
    attn = A.PagedAttention(d, 0.3, None, kb)
    attn.kv_quant = KVQuant(algo, owner)
    dtype = KV_DTYPES[algo]
    k_pool, v_pool = torch.zeros(6, BLOCK, kvh, d, dtype=dtype), torch.zeros(6, BLOCK, kvh, d, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    table = [[3, 1, 4]]
    ks, vs = [], []
    for step, (new, ctx) in enumerate([(n, 0), (1, n), (1, n + 1)]):
        q = torch.randn(new, h, d, generator=g)
        k, v = torch.randn(new, kvh, d, generator=g), torch.randn(new, kvh, d, generator=g) * 2
        meta = M.AttentionMetadata.build([new], [ctx], table, BLOCK)
        out = attn(q, k, v, meta, k_pool, v_pool)
        s = owner.kv_cache_scaling_factor
        ks.append(dequantize_kv(quantize_kv(k, s[0], dtype), s[0], torch.float32))
        vs.append(dequantize_kv(quantize_kv(v, s[1], dtype), s[1], torch.float32))
        if step == 0:  # the prompt attends over its own keys, before they are quantized
            keys, values = k, v
        else:
            keys, values = torch.cat(ks), torch.cat(vs)
        ref = dense_reference(q, keys, values, torch.arange(ctx, ctx + new), torch.arange(ctx + new), 0.3,
                              key_bias=kb)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
