"""Calibrated quantization on tensor-parallel ranks: quantize once on the whole model, then cut.

`convert --tp_size 2` with a calibrated mode converts the tp 1 checkpoint (calibration, SmoothQuant /
AWQ scales, GPTQ, KV scales: all on the whole model) and cuts each of its tensors into the ranks with
the float weights' split rules (core.convert.quantize_calibrated.write_sharded_rank). The tiny LLaMA here has one
kv head (replicated on both ranks: the kv rows of the packed qkv weight, its scales and its bias are
copies) and biases on every linear. For each mode:

- the rank files re-assemble (tests/parity.reassemble_checkpoint, which also checks replicated copies
  are equal) bit for bit to a separate tp 1 convert's tensors;
- the tp 2 engine's logits over an 8-token prefill and 16 teacher-forced decode steps are within
  REL_TOL * max|logit| of tp 1's, and its greedy tokens equal tp 1's up to tp 1's first step whose
  top-2 margin the measured difference could bridge.

The bound, and why: the ranks' arithmetic is tp 1's except the order of the sums (each row-parallel
layer adds two partial sums where tp 1 adds one). The activation-quantized modes multiply exact
integer / FP8 codes with float32 accumulation, and each layer re-quantizes its input to a static
scale, which absorbs those 1e-7 differences: their logits came out bit-identical at every step, so
most steps must be within LOGIT_TOL (1e-5); a difference that lands on a rounding boundary may flip
one activation (or KV) code and move later logits by about one code step, hence a 1e-2 relative
bound for the worst step. Weight-only int4 (GPTQ) runs the compiled CPU kernels' float32 GEMV for
steps of at most 8 tokens (hence the 8-token prompt; about 1e-6 measured), but multiplies in bfloat16
on longer prefills and without the compiled kernels (WeightOnlySlot.compute_dtype), where two
ranks' partial sums round differently: the same 1e-2 relative bound test_tp_runtime uses for W4A16.

Calibration reads 128 random token ids here (no tokenizer; RANDOM_CALIB_TOKENS patched down) and GPTQ
tunes its scales for one step, to stay fast. The tp 2 engines run on the module-wide 2-rank worker
group that tests/runtime/test_tp_runtime.py uses.
"""

from __future__ import annotations

import pytest
import torch
from parity import reassemble_checkpoint
from test_tp_runtime import LOGIT_TOL, STEPS, teacher_forced
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.config import QuantConfig
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

pytest.importorskip("transformers")

REL_TOL = 1e-2
PROMPT = [52, 40, 27, 20, 18, 45, 49, 83]  # 8 tokens: the int4 prefill runs the kernels too (see above)
MODES = {  # mode -> ConvertOptions fields (quant_algo names: core.quant.modes)
    "fp8_fp8kv": dict(quantization=QuantConfig(quant_algo="FP8", kv_cache_quant_algo="FP8")),
    "sq_int8kv": dict(quantization=QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", kv_cache_quant_algo="INT8")),
    "w4a8_awq": dict(quantization=QuantConfig(quant_algo="W4A8_AWQ", group_size=32, pre_quant_scale=True)),
    "gptq_int4": dict(quantization=QuantConfig(quant_algo="W4A16", group_size=32), weight_quantizer="gptq",
                      tune_steps=1),
}
ACT_MODES = ("fp8_fp8kv", "sq_int8kv", "w4a8_awq")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """mode -> (tp 1 checkpoint, tp 2 checkpoint), converted on first use."""
    root = tmp_path_factory.mktemp("tp_quant")
    # kv 1 < tp 2: replicated kv heads; hidden 64 / intermediate 128: row-parallel inputs of 32 / 64 per rank
    src = make_tiny_llama(root / "src", num_key_value_heads=1, intermediate_size=128, attention_bias=True,
                          mlp_bias=True)
    made: dict[str, tuple] = {}

    def get(mode: str):
        if mode not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("bestiary.core.convert.quantize_calibrated.RANDOM_CALIB_TOKENS", 128)
                made[mode] = tuple(convert(src, root / f"{mode}_tp{tp}", ConvertOptions(tp_size=tp, **MODES[mode]),
                                           show_progress=False) for tp in (1, 2))
        return made[mode]

    return get


def first_close_call(logits: torch.Tensor, diff: float) -> int:
    """Index of the first row whose top-2 margin is below 2 * `diff` (a logit difference of `diff` could
    swap its argmax), len(logits) when none."""
    margins = logits.topk(2, dim=-1).values  # [rows, 2]
    close = ((margins[:, 0] - margins[:, 1]) < 2 * diff).nonzero()
    return int(close[0]) if len(close) else len(logits)


def assert_tp2_runs_like_tp1(tp1_dir, tp2_dir, act_quantized: bool) -> None:
    """Logits within REL_TOL * max|logit| (activation-quantized: most steps within LOGIT_TOL), greedy
    tokens equal up to tp 1's first step whose top-2 margin the measured difference could bridge."""
    ref, tokens = teacher_forced(Engine.load(tp1_dir), PROMPT)
    llm = LLM(tp2_dir, num_threads=1)
    try:
        assert llm.engine.model.tp_size == 2
        ours, _ = teacher_forced(llm.engine, PROMPT, tokens)
        per_step = (ours - ref).abs().amax(dim=-1)  # [1 + STEPS]
        scale = ref.abs().max().item()
        assert per_step.max().item() <= REL_TOL * scale, f"max |tp2 - tp1| = {per_step.max().item():.3g}"
        if act_quantized:
            assert per_step.median().item() <= LOGIT_TOL, f"per-step max |tp2 - tp1| {per_step.tolist()}"
        agree = first_close_call(ref, max(per_step.max().item(), LOGIT_TOL))
        assert agree >= STEPS // 2, f"tp 1 has a near-tie at step {agree}; pick another prompt"
        (out,) = llm.generate([PROMPT], SamplingConfig(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
        assert out.output_ids[:agree] == tokens[:agree]
    finally:
        llm.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_calibrated_tp2_is_the_tp1_checkpoint_cut(mode, checkpoints):
    tp1, tp2 = checkpoints(mode)
    whole, reference = reassemble_checkpoint(tp2), load_rank_weights(tp1, 0)
    assert set(whole) == set(reference)
    for key, tensor in reference.items():
        assert whole[key].dtype == tensor.dtype and torch.equal(whole[key], tensor), key
    qkv = "transformer.layers.0.attention.qkv.weight"
    ranks = [load_rank_weights(tp2, r)[qkv] for r in (0, 1)]
    assert ranks[0].shape[0] == reference[qkv].shape[0] - 16 * 2  # (4 + 2 * 1) heads of 16 -> 2 q + 1 k + 1 v
    assert torch.equal(ranks[0][32:], ranks[1][32:])  # the one kv head on both ranks
    assert_tp2_runs_like_tp1(tp1, tp2, mode in ACT_MODES)


def test_imported_gptq_tp2_runs_like_tp1(tmp_path):
    """An HF GPTQ checkpoint (act-order: random over the column-parallel inputs, per rank half over the
    row-parallel ones, so each rank's in_perm is a real permutation) runs at tp 2 like at tp 1."""
    from test_quant_import import make_quantized

    act_order = {"attn_in": "random", "mlp_in": "random", "o": "local", "down": "local"}
    qdir, _ = make_quantized(tmp_path, "gptq", 32, act_order=act_order)
    tp1, tp2 = (convert(qdir, tmp_path / f"tp{tp}", ConvertOptions(tp_size=tp), show_progress=False) for tp in (1, 2))
    assert load_rank_weights(tp2, 1)["transformer.layers.0.mlp.proj.in_perm"].dtype == torch.int32
    assert_tp2_runs_like_tp1(tp1, tp2, act_quantized=False)
