"""gpt-oss against transformers' GptOssForCausalLM: the conformance kit over prefill + 16 decode steps (banded and
full layers with sink logits, YaRN), each mechanism shown exercised (sink logits, the banded layers, the SwiGLU
clamp, YaRN: switched off in transformers the logits move by > 100x the bound, and off in bestiary they miss by as
much), cached-context prefill and prefix reuse with sinks, tp 2 and ep 2 equal to tp 1, the sink attention op
against a float64 formula, and MXFP4 experts: the spec's packing dequantized equal to transformers' own
dequantization, and a tiny MXFP4 checkpoint converted to the logits of transformers on the dequantized weights.

Tiny random fp32 models from transformers' own GptOssConfig (weights re-drawn by parity.reinit_); swiglu_limit 1
so the clamp bites, sliding_window 4 < the 12-token prompt so the band matters.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402
from bestiary.testing.parity import assert_split_matches, mechanism_miss  # noqa: E402

STEPS = 16
TINY = dict(model_type="gpt_oss", vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=4, max_position_embeddings=128, swiglu_limit=1.0)
PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}
# layer 0 banded (window 4), layer 1 full (transformers' even / odd rule); yarn: transformers' GptOssConfig default
# rope (factor 32 over 4096 original positions, beta_fast 32, beta_slow 1, truncate false), and heads x head_dim
# (4 x 32) wider than hidden (64), as gpt-oss-20b's 64 x 64 over 2880.
GPT_OSS = {"banded_sinks": TINY | PLAIN_ROPE,
           "yarn": TINY | dict(max_position_embeddings=131072, head_dim=32)}
TestGptOss = conformance("GptOssForCausalLM", GPT_OSS, steps=STEPS)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(reference, source, tp 1 engine) of the banded_sinks case."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.references import as_reference

    root = tmp_path_factory.mktemp("gpt_oss")
    reference = as_reference(GPT_OSS["banded_sinks"])
    source = reference.save(root / "source")
    return reference, source, Engine.load(convert(source, root / "tp1", show_progress=False))


def _modules(engine, cls) -> list:
    return [m for m in engine.model.modules() if isinstance(m, cls)]


def test_sink_logits_are_exercised(built):
    """Without the sink logits (HF: sinks -inf, no mass; ours: none) the logits move by > 100x the bound."""
    from bestiary.core.layers.attention import PagedAttention

    reference, _, engine = built
    hf_attns = [layer.self_attn for layer in reference.model.model.layers]
    saved = [a.sinks.data.clone() for a in hf_attns]
    ours = _modules(engine, PagedAttention)
    logits = [a.sink_logits for a in ours]
    assert len(ours) == 2 and all(s is not None and s.shape == (4,) for s in logits)

    def flip_hf(on: bool) -> None:
        for a, s in zip(hf_attns, saved, strict=True):
            a.sinks.data = s.clone() if on else torch.full_like(s, float("-inf"))

    def flip_ours(on: bool) -> None:
        for a, s in zip(ours, logits, strict=True):
            a.sink_logits = s if on else None

    bound, hf_moved, ours_moved = mechanism_miss(reference, engine, flip_hf, flip_ours)
    assert hf_moved > 100 * bound and ours_moved > 100 * bound, (bound, hf_moved, ours_moved)


def test_banded_layers_are_exercised(built):
    """Layer 0 attends through window 4 (< the prompt), layer 1 to every key, as transformers' layer_types say;
    with the band lifted (every layer full) the logits move by > 100x the bound."""
    from bestiary.core.layers.attention import PagedAttention

    reference, _, engine = built
    config = reference.model.config
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert engine.model.attention_windows == [4, 0]
    ours = _modules(engine, PagedAttention)

    def flip_hf(on: bool) -> None:
        config.layer_types = ["sliding_attention", "full_attention"] if on else ["full_attention"] * 2
        reference.model.model.layers[0].self_attn.sliding_window = 4 if on else None

    def flip_ours(on: bool) -> None:
        ours[0].window = 4 if on else 0

    bound, hf_moved, ours_moved = mechanism_miss(reference, engine, flip_hf, flip_ours)
    assert hf_moved > 100 * bound and ours_moved > 100 * bound, (bound, hf_moved, ours_moved)


def test_swiglu_clamp_is_exercised(built):
    """swiglu_limit 1: some gate / up activations pass it, and without the clamp the logits move by > 100x."""
    from bestiary.core.layers.moe import MoE

    reference, _, engine = built
    experts = [layer.mlp.experts for layer in reference.model.model.layers]
    moes = _modules(engine, MoE)
    assert moes and all(m.glu is not None and m.glu.limit == 1.0 and m.glu.alpha == 1.702 for m in moes)
    seen: list[float] = []
    hooks = [m.glu for m in moes]

    def watch(glu):
        def call(g, u):
            seen.append(max(g.max().item(), u.abs().max().item()))
            return type(glu).__call__(glu, g, u)
        return call

    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.suite import PROMPT

    for m, glu in zip(moes, hooks, strict=True):
        m.glu = watch(glu)
    try:
        reference_diffs(engine, reference.logits, PROMPT, 0)
    finally:
        for m, glu in zip(moes, hooks, strict=True):
            m.glu = glu
    assert max(seen) > 1.0  # the clamp bites

    def flip_hf(on: bool) -> None:
        for e in experts:
            e.limit = 1.0 if on else float("inf")

    def flip_ours(on: bool) -> None:
        for m in moes:
            m.glu.limit = 1.0 if on else float("inf")

    bound, hf_moved, ours_moved = mechanism_miss(reference, engine, flip_hf, flip_ours)
    assert hf_moved > 100 * bound and ours_moved > 100 * bound, (bound, hf_moved, ours_moved)


def test_yarn_is_exercised(tmp_path):
    """The yarn case's logits move by > 100x the bound with transformers' default rope on the same weights, and our
    engine (YaRN, core.layers.yarn) misses that plain-rope reference by as much while the kit holds it to YaRN's."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import hf_logits, reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(GPT_OSS["yarn"])
    model = reference.model
    assert model.config.rope_parameters["rope_type"] == "yarn"
    engine = Engine.load(convert(reference.save(tmp_path / "src"), tmp_path / "ckpt", show_progress=False))
    assert engine.config.rotary_scaling["rope_type"] == "yarn" and engine.config.rotary_scaling["factor"] == 32.0
    yarn = hf_logits(model, PROMPT)
    bound = 1e-4 * max(1.0, yarn.abs().max().item())
    rotary = model.model.rotary_emb
    plain_config = type(model.config)(**{**model.config.to_dict(), **PLAIN_ROPE})
    model.model.rotary_emb = GptOssRotaryEmbedding(plain_config)
    try:
        hf_moved = (hf_logits(model, PROMPT) - yarn).abs().max().item()
        ours_vs_plain = reference_diffs(engine, reference.logits, PROMPT, 1)[0]
    finally:
        model.model.rotary_emb = rotary
    assert hf_moved > 100 * bound and ours_vs_plain > 100 * bound, (bound, hf_moved, ours_vs_plain)
    assert reference_diffs(engine, reference.logits, PROMPT, 1)[0] <= bound


def test_chunked_prefill_and_prefix_reuse_with_sinks(built):
    """The prompt fed in chunks (each later chunk attends over cached blocks, banded and full, with sink logits)
    gives the whole prefill's logits; an executor with small blocks and steps (chunked prefill) reusing a shared
    prefix generates transformers' greedy tokens."""
    from bestiary.core.format.build_config import BuildConfig, finalize_build_config
    from bestiary.core.runtime.executor import Executor
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.parity import EngineRunner, hf_greedy

    reference, _, engine = built
    prompt = [(7 * i + 3) % 96 for i in range(22)]
    whole = EngineRunner(engine, block_size=4).feed(prompt, all_logits=True)
    runner = EngineRunner(engine, block_size=4)
    chunks = torch.cat([runner.feed(prompt[a:b], all_logits=True) for a, b in ((0, 5), (5, 6), (6, 15), (15, 22))])
    assert (chunks - whole).abs().max().item() <= 1e-5

    build = finalize_build_config(BuildConfig(tokens_per_block=4, max_num_tokens=6, max_seq_len=64),
                                  engine.config.model_dump())
    ex = Executor(engine.model, build)
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for tail in ([5, 6], [9, 10, 11]):  # one after the other: the second reuses the first's full blocks
        req = ex.add(prompt + tail, greedy)
        while ex.has_work:
            ex.step()
        outputs.append((prompt + tail, req.output))
    assert ex.allocator.stats.hit_blocks > 0
    for ids, out in outputs:
        tokens, near_tie = hf_greedy(reference.model, ids, 8)
        end = 8 if near_tie is None else near_tie
        assert out[:end] == tokens[:end]


def test_bestiary_list_shows_it(capsys):
    """`bestiary list` has a GptOssForCausalLM row from package bestiary claiming model_type gpt_oss."""
    from bestiary.core.cli.main import main

    assert main(["list"]) == 0
    rows = [[cell.strip() for cell in line.split("\u2502")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("\u2502")]
    row = next(r for r in rows if r and r[0] == "GptOssForCausalLM")
    assert row[1] == "bestiary" and row[3] == "gpt_oss"


def test_decode_plan_names_the_sink_logits(built):
    """The compiled CPU decode plan and CUDA graphs have no sink logits: the model runs eagerly, the reasons say so."""
    from bestiary.core.runtime import cpu_plan, cuda_graph

    model = built[2].model
    reason = cpu_plan.refusal(model)
    assert reason is not None and "sink logits" in reason
    model.__dict__.pop("cuda_graph_refusal", None)
    assert "sink logits" in (cuda_graph.model_refusal(model) or "")


def test_w4a16_dense_linears_and_int8_kv(built, tmp_path):
    """W4A16 quantizes the dense linears only (q/k/v, o, lm_head; the router and experts stay float) and runs; an
    INT8 KV cache (sink layers attend over the dequantized blocks) stays within 2% of transformers' logit range."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.config import QuantConfig
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import EngineRunner, reference_diffs
    from bestiary.testing.suite import PROMPT

    reference, source, _ = built
    options = ConvertOptions(quantization=QuantConfig(quant_algo="W4A16", group_size=32), weight_quantizer="rtn")
    engine = Engine.load(convert(source, tmp_path / "w4", options, show_progress=False))
    quantized = sorted(n for n, m in engine.model.named_modules() if getattr(m, "quant", None) is not None)
    assert quantized == ["lm_head"] + [f"transformer.layers.{i}.attention.{p}" for i in (0, 1) for p in ("dense", "qkv")]
    assert EngineRunner(engine).feed(PROMPT, all_logits=True).isfinite().all()
    kv = ConvertOptions(quantization=QuantConfig(kv_cache_quant_algo="INT8"))
    engine = Engine.load(convert(source, tmp_path / "kv", kv, show_progress=False))
    diff, scale = reference_diffs(engine, reference.logits, PROMPT, 4)
    assert diff <= 0.02 * scale, (diff, scale)


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, moe_ep_size=2)], ids=["tp2", "ep2"])
def test_tp2_and_ep2_engines_equal_tp1(built, layout, tmp_path):
    """tp 2 (heads and their sink logits split, experts along their FFN dim, the down bias added once) and ep 2
    (two whole experts per rank): within the kit's bound of transformers over prefill + 16 steps, tp 1's greedy
    tokens."""
    reference, source, engine = built
    assert_split_matches(reference, source, engine, tmp_path / "split", STEPS, **layout)


def test_config_reads_published_fields():
    """openai/gpt-oss-20b's config.json fields (rope_scaling yarn, rope_theta, explicit layer_types, mxfp4) read
    as published; a config naming no rope and no layer_types takes transformers' defaults (YaRN, even layers
    banded, window 128)."""
    from bestiary.core.format.config import Mapping
    from bestiary.models.gpt_oss.model import HF_YARN, from_hf_config

    yarn = dict(HF_YARN)
    published = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
                     intermediate_size=2880, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8,
                     head_dim=64, num_local_experts=32, experts_per_token=4, num_experts_per_tok=4,
                     sliding_window=128, rope_theta=150000, rope_scaling=yarn, swiglu_limit=7.0, rms_norm_eps=1e-05,
                     layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True,
                     max_position_embeddings=131072, quantization_config={"quant_method": "mxfp4"})
    config = from_hf_config(published, "bfloat16", Mapping())
    assert (config.num_local_experts, config.num_experts_per_tok, config.sliding_window, config.rotary_base) == \
        (32, 4, 128, 150000.0)
    assert config.rotary_scaling["rope_type"] == "yarn" and config.rotary_scaling["factor"] == 32.0
    assert config.qkv_bias and config.dense_bias and config.swiglu_alpha == 1.702
    bare = {k: v for k, v in published.items() if k not in ("rope_scaling", "rope_theta", "layer_types",
                                                            "sliding_window")}
    config = from_hf_config(bare, "bfloat16", Mapping())
    assert config.rotary_scaling == HF_YARN and config.rotary_base == 150000.0 and config.sliding_window == 128
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2


# --- the sink attention op ---------------------------------------------------------------------------------------

H, KVH, D, BS = 4, 2, 8, 4


def sink_reference(q, k, v, q_pos, window, sinks, scale):
    """float64: p_ij = exp(s_ij) / (exp(a_h) + sum_j' exp(s_ij')), out_i = sum_j p_ij v_j over the visible keys
    (causal, within `window` when not 0): q [n, H, D], k / v [L, KVH, D] -> [n, H * D]."""
    q, k, v, a = q.double(), k.double(), v.double(), sinks.double()
    kk, vv = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)  # [L, H, D]
    s = torch.einsum("nhd,lhd->hnl", q, kk) * scale
    j, i = torch.arange(k.shape[0])[None, :], q_pos[:, None]
    visible = (j <= i) & ((window == 0) | (i - j < window))
    e = torch.exp(s).masked_fill(~visible[None], 0.0)  # [H, n, L]
    p = e / (torch.exp(a)[:, None, None] + e.sum(-1, keepdim=True))
    return torch.einsum("hnl,lhd->nhd", p, vv).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window", [0, 3])
def test_sink_attention_is_the_formula_over_the_paged_cache(window):
    """Prefill in two chunks (the second over the pool) and two batched decode steps, two sequences with blocks out
    of order, GQA, banded or full: the float64 formula within 1e-5; without the sink logits it misses."""
    from bestiary.core.kernels import dispatch
    from bestiary.core.kernels.attention_ref import write_kv
    from bestiary.core.kernels.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    lens, tables, scale = [9, 6], [[3, 0, 5], [1, 4]], 0.6
    k_all = [torch.randn(n + 2, KVH, D, generator=gen) for n in lens]
    v_all = [torch.randn(n + 2, KVH, D, generator=gen) for n in lens]
    q_all = [torch.randn(n + 2, H, D, generator=gen) for n in lens]
    sinks = torch.tensor([2.0, -1.0, 0.5, 3.0])
    pools = torch.zeros(2, 8, BS, KVH, D)
    for seq_lens, ctx in [([5, 4], [0, 0]), ([4, 2], [5, 4]), ([1, 1], [9, 6]), ([1, 1], [10, 7])]:
        meta = AttentionMetadata.build(seq_lens, ctx, tables, BS)
        pick = [slice(c, c + n) for c, n in zip(ctx, seq_lens, strict=True)]
        q = torch.cat([q_all[b][pick[b]] for b in range(2)])
        k, v = torch.cat([k_all[b][pick[b]] for b in range(2)]), torch.cat([v_all[b][pick[b]] for b in range(2)])
        write_kv(pools[0], pools[1], k, v, meta.slot_mapping)
        out = dispatch.paged_attention(q, k, v, meta, pools[0], pools[1], scale, None, window=window,
                                       sink_logits=sinks)
        expected = torch.cat([sink_reference(q_all[b][pick[b]], k_all[b][: ctx[b] + seq_lens[b]],
                                             v_all[b][: ctx[b] + seq_lens[b]],
                                             torch.arange(ctx[b], ctx[b] + seq_lens[b]), window, sinks, scale)
                              for b in range(2)]).float()
        assert (out - expected).abs().max().item() <= 1e-5, (seq_lens, ctx)
        plain = dispatch.paged_attention(q, k, v, meta, pools[0], pools[1], scale, None, window=window)
        assert (plain - expected).abs().max().item() > 1e-2  # the sinks take mass


# --- MXFP4 ---------------------------------------------------------------------------------------------------------


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX v1.0 MXFP4, written from the spec: E2M1 codes [..., 32 G] (0..15) and E8M0 scales [..., G] (0..254)
    -> blocks uint8 [..., G, 16] (element 2i in the low nibble, 2i + 1 in the high one), scales uint8 [..., G]."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 16, 2))  # [..., G, 16, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4), exponents.to(torch.uint8)


def spec_values(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """What the spec says the packed elements are, in float64: (-1)^s 2^(e-1) (1 + m/2) (e > 0) or (-1)^s m/2,
    times 2^(scale - 127): codes [..., 32 G], exponents [..., G] -> [..., 32 G]."""
    c = codes.long()
    e, m = ((c >> 1) & 3).double(), (c & 1).double()
    value = torch.where(e > 0, torch.exp2(e - 1) * (1 + m / 2), m / 2) * torch.where(c & 8 > 0, -1.0, 1.0)
    return value * torch.exp2(exponents.double() - 127).repeat_interleave(32, -1)


def test_mxfp4_dequantizes_as_the_spec_and_transformers():
    """Random codes and scales (the whole E8M0 range but NaN) packed per the spec dequantize to the spec's values,
    equal to transformers' convert_moe_packed_tensors of the same bytes (exactly, float32 and bfloat16)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from bestiary.core.sources.mxfp4 import dequantize

    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (3, 5, 4 * 32), generator=gen)  # [E, N, K]
    exponents = torch.randint(0, 255, (3, 5, 4), generator=gen)  # [E, N, G]
    blocks, scales = pack_mxfp4(codes, exponents)
    ours = dequantize(blocks, scales, torch.float32)  # [E, N, K]
    assert torch.equal(ours.double(), spec_values(codes, exponents))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize(blocks, scales, torch.bfloat16).float(), ours)
    assert dequantize(blocks, torch.full_like(scales, 255), torch.float32).isnan().all()  # E8M0 NaN


def _mxfp4_source(reference, directory) -> None:
    """Give `reference`'s experts MXFP4-representable weights (random codes, scales 2^-5 .. 2^-3), save it, and
    rewrite its safetensors with gate_up_proj / down_proj as *_blocks / *_scales, config quant_method mxfp4."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(5)
    packed = {}
    for i, layer in enumerate(reference.model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)  # [E, K, N]
            e, k, n = param.shape
            codes = torch.randint(0, 16, (e, n, k), generator=gen)
            blocks, scales = pack_mxfp4(codes, torch.randint(122, 125, (e, n, k // 32), generator=gen))
            param.data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
            packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    reference.save(directory)
    tensors = load_file(directory / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))} | packed
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("inter", [32, 64])
def test_mxfp4_checkpoint_converts_to_transformers_logits(inter, tmp_path):
    """A tiny checkpoint with MXFP4 experts converts (dequantized on read) to transformers' logits on the dequantized
    weights over prefill + 16 steps (from the directory, and from its .safetensors file); its tp 2 and ep 2
    checkpoints hold exactly the float source's tensors (the
    blocks cut per rank: experts, out rows, and down_proj's I in features: one group of 32 cut after dequantizing,
    two groups cut before)."""
    from safetensors.torch import load_file

    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(GPT_OSS["banded_sinks"] | dict(intermediate_size=inter))
    _mxfp4_source(reference, tmp_path / "mxfp4")
    reference.save(tmp_path / "float")
    engine = Engine.load(convert(tmp_path / "mxfp4", tmp_path / "ckpt", show_progress=False))
    diff, scale = reference_diffs(engine, reference.logits, PROMPT, STEPS)
    assert diff <= 1e-4 * max(1.0, scale), diff
    single = convert(tmp_path / "mxfp4" / "model.safetensors", tmp_path / "single", show_progress=False)
    ta, tb = (load_file(d / "rank0.safetensors") for d in (single, tmp_path / "ckpt"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)  # a .safetensors file source
    for layout in (dict(tp_size=2), dict(tp_size=2, moe_ep_size=2)):
        a = convert(tmp_path / "mxfp4", tmp_path / "a", ConvertOptions(**layout), show_progress=False)
        b = convert(tmp_path / "float", tmp_path / "b", ConvertOptions(**layout), show_progress=False)
        for rank in (0, 1):
            ta, tb = (load_file(d / f"rank{rank}.safetensors") for d in (a, b))
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), (layout, rank)


def test_mxfp4_pair_missing_a_scale_is_one_line(tmp_path):
    """A *_blocks tensor without its *_scales is a WeightsError naming the file and the tensor."""
    from safetensors.torch import load_file, save_file

    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.format.errors import WeightsError
    from bestiary.testing.references import as_reference

    reference = as_reference(GPT_OSS["banded_sinks"])
    _mxfp4_source(reference, tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="model.layers.1.mlp.experts.down_proj_blocks has no .*down_proj_scales"):
        convert(tmp_path / "src", tmp_path / "ckpt", show_progress=False)
