"""Compiled CPU decode plans (core.runtime.cpu_plan) give the eager torch path's logits and tokens.

Each case generates with the plan (default dispatch) and with every op on its torch
reference (kernels_mode("torch"), which also turns plans off), three requests at once so the
decode steps run batched, and compares the raw generation logits step by step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.config import QuantConfig
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.cpu import build as cpu_build
from bestiary.core.quant.apply import set_compute_dtype
from bestiary.core.runtime.cpu_plan import MAX_BATCH, OP_ATTENTION, DecodePlan, plan_for
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.model import DecoderLM
from bestiary.core.runtime.sampling import SamplingConfig

# skipped only where nothing can build the kernels: with a compiler, a kernels.c that does not build
# fails here (tests/kernels/cpu/test_cpu_isa.py::test_kernels_build_where_a_compiler_is) instead of skipping
pytestmark = pytest.mark.skipif(cpu_build.compiler() is None or not cpu_build.enabled(),
                                reason="no C compiler (or BESTIARY_CPU_KERNELS=off): the kernels are not built")

PROMPTS = [[5, 17, 3, 90, 41], [7] * 23, [11, 2, 64, 8, 19, 33, 71, 5, 9, 28, 44, 60, 2]]
CASES = {  # name -> (dtype, quantization, relative logits tolerance)
    "fp32": ("float32", None, 1e-4),
    "bf16": ("bfloat16", None, 3e-2),
    "w8a16": ("float32", QuantConfig(quant_algo="W8A16"), 1e-4),
    "w4a16_g32_zp": ("float32", QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True), 1e-4),
    # bfloat16 scales and zero points: the quads' tiles keep them so on the avx2 build (ops.quads_scales)
    "bf16_w4a16_g32_zp": ("bfloat16", QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True), 3e-2),
    # INT8 / FP8 KV: the plan writes and reads the codes. Float noise of 1e-6 between compiled and
    # torch ops can flip an odd code by a step (FP8: 1/8 of the value), so these compare with the
    # eager path on the compiled kernels (whose decode attention reads the codes too).
    "int8_kv": ("float32", QuantConfig(kv_cache_quant_algo="INT8"), 1e-4),
    "w8a16_fp8_kv": ("float32", QuantConfig(quant_algo="W8A16", kv_cache_quant_algo="FP8"), 1e-4),
    "bf16_int8_kv": ("bfloat16", QuantConfig(kv_cache_quant_algo="INT8"), 3e-2),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("plan"), intermediate_size=96, tie_word_embeddings=True)


def _llm(hf_dir, tmp_path, dtype, quant) -> LLM:
    kw = {"quantization": quant} if quant else {}
    if quant is not None and quant.quant_algo:
        kw["weight_quantizer"] = "rtn"
    convert(hf_dir, tmp_path / "ckpt", ConvertOptions(dtype=dtype, **kw), show_progress=False)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_batch_size=4, max_seq_len=96,
                                                                       tokens_per_block=8))
    return _float32_gemms(LLM(tmp_path / "engine"), dtype, quant)


def _float32_gemms(llm: LLM, dtype: str, quant) -> LLM:
    """A step past the quantized GEMV's row bound dequantizes and multiplies in bf16 (the "A16"). A
    second run that reuses the first one's cached prefix has a shorter prefill step, which may stay
    under the bound: in float32 engines, float32 GEMMs make prefills agree whatever their length."""
    if quant is not None and quant.quant_algo and dtype == "float32":
        set_compute_dtype(llm.engine.model, torch.float32)
    return llm


def _generate(llm: LLM):
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True, output_generation_logits=True)
    return llm.generate(PROMPTS, cfg)


# every case on the best build this CPU runs; on the other builds (AVX2, scalar on an AVX-512
# CPU) the cases that between them run every compiled op. Plain AVX-512 beside avx512bf16 differs
# only where both operands are bf16 (vdpbf16ps there): the bf16 case.
ISA_CASES = ("fp32", "bf16", "w4a16_g32_zp", "w8a16_fp8_kv")


def isa_cases(isa: str) -> tuple[str, ...]:
    return ("bf16",) if isa == "avx512" and "avx512bf16" in cpu_build.supported_isas() else ISA_CASES


PLAN_RUNS = [(case, "auto") for case in CASES] + [(case, isa) for isa in cpu_build.supported_isas()[1:]
                                                  for case in isa_cases(isa)]


@pytest.fixture
def forced_isa(request, monkeypatch):
    """BESTIARY_CPU_ISA for the test (auto: the default choice); library re-chosen before and after."""
    monkeypatch.setenv(cpu_build.ISA_ENV_VAR, request.param)
    cpu_build.library.cache_clear()
    yield request.param
    cpu_build.library.cache_clear()


@pytest.mark.parametrize("case,forced_isa", PLAN_RUNS, indirect=["forced_isa"])
def test_plan_equals_eager_torch(hf_dir, tmp_path, case, forced_isa, monkeypatch):
    dtype, quant, tol = CASES[case]
    expected = cpu_build.supported_isas()[0] if forced_isa == "auto" else forced_isa
    assert cpu_build.library().bst_isa() == cpu_build.ISAS[expected].code
    llm = _llm(hf_dir, tmp_path, dtype, quant)
    planned = _generate(llm)
    plans = llm.executor.model.__dict__.get("_decode_plans", {})
    assert any(p is not None for p in plans.values()), "no decode step ran as a plan"
    assert 3 in plans and plans[3] is not None  # the three requests decoded together

    def no_plan(*args):
        raise AssertionError("a plan ran under kernels_mode('torch')")

    monkeypatch.setattr(DecodePlan, "run", no_plan)  # the plans built above must not run now
    if quant is not None and quant.kv_cache_quant_algo:
        # a fresh LLM: a reused prefix would be read back as codes, where the first run's prefill
        # attended over its own float K/V (as TensorRT-LLM's context phase does)
        monkeypatch.setattr(DecoderLM, "_decode_plan", lambda *args: None)
        eager = _generate(_float32_gemms(LLM(tmp_path / "engine"), dtype, quant))
    else:
        with dispatch.kernels_mode("torch"):
            eager = _generate(llm)
    assert_same_generation(planned, eager, case, tol)


def assert_same_generation(planned, eager, case: str, tol: float) -> None:
    """Up to the first token that differs, the two runs saw the same inputs: their logits agree within
    tol; a differing token must be a near tie of the reference (bf16 rounds in other places)."""
    for a, b in zip(planned, eager, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(b.output_ids))
        steps = min(same + 1, len(b.output_ids))
        ours, ref = a.generation_logits[:steps], b.generation_logits[:steps]
        scale = ref.abs().max().item()
        diff = (ours - ref).abs().max().item()
        assert diff <= tol * scale, f"{case}: logits differ by {diff:.3g} (max |logit| {scale:.3g})"
        if same < len(b.output_ids):
            top2 = ref[same].topk(2).values
            assert tol > 1e-4 and (top2[0] - top2[1]).item() <= 2 * tol * scale, f"{case}: step {same}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plans_of_a_shrinking_batch_share_buffers_and_equal_eager(hf_dir, tmp_path, dtype):
    """Requests that end one after the other: the batch shrinks 3 -> 2 -> 1, each size its own plan.
    The plans write the same activation buffers (StepBuffers: rows [:b] of one set, the same one for
    every layer), and each step's logits are still the eager path's."""
    llm = _llm(hf_dir, tmp_path, dtype, None)
    configs = [SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True, output_generation_logits=True)
               for n in (4, 8, 12)]
    planned = llm.generate(PROMPTS, configs)
    plans = llm.executor.model.__dict__["_decode_plans"]
    assert all(plans.get(b) is not None for b in (1, 2, 3))
    for name in ("x", "y", "delta", "logits", "tables"):
        assert len({getattr(plans[b], name).data_ptr() for b in (1, 2, 3)}) == 1, name
    linear_outputs = {r.p[5] for r in plans[3].records if r.op == 2}  # OP_LINEAR's out: one buffer per role
    assert len(linear_outputs) == 4  # qkv, delta (dense and proj), fc|gate, logits: not a set per layer
    with dispatch.kernels_mode("torch"):
        eager = llm.generate(PROMPTS, configs)
    case = "bf16" if dtype == "bfloat16" else "fp32"
    assert_same_generation(planned, eager, case, CASES[case][2])


def test_a_resized_plan_has_a_fresh_plans_records(hf_dir, tmp_path):
    """plan_for(..., like=plan) resizes `plan` instead of walking the model: every record equals the one
    a new plan of that batch has (op, dtypes, integers, floats, pointers), but the attention records'
    sequence rows, which are the resized plan's own [3, b]. Past the buffers' capacity, with tp stop
    points or widened tables, it builds anew."""
    llm = _llm(hf_dir, tmp_path, "float32", None)
    model, kv = llm.executor.model, llm.executor.kv
    pools = (list(kv.k), list(kv.v))
    big = plan_for(model, 4, *pools)
    for b in (1, 3, 4, 8):
        small = plan_for(model, b, *pools, like=big)
        fresh = DecodePlan(model, b, *pools)
        assert small is not big and small.batch == b and small.buffers is big.buffers is fresh.buffers
        windows = iter(w for _, w in small.windows)
        for a, f in zip(small.records, fresh.records, strict=True):
            assert (a.op, list(a.dt), list(a.i), list(a.f)) == (f.op, list(f.dt), list(f.i), list(f.f))
            pa, pf = list(a.p), list(f.p)
            if a.op == OP_ATTENTION:
                window = next(windows)
                assert pa[4] == small.seq_rows[window].data_ptr() and pf[4] == fresh.seq_rows[window].data_ptr()
                pa[4] = pf[4] = None
            assert pa == pf
    assert big.resized(big.buffers.capacity + 1) is None
    big._widen_tables(big.tables.shape[1] + 1)
    assert big.resized(2) is None


def test_unsupported_models_get_no_plan(hf_dir, tmp_path):
    llm = _llm(hf_dir, tmp_path, "float32", None)
    model, kv = llm.executor.model, llm.executor.kv
    assert plan_for(model, 1, list(kv.k), list(kv.v)) is not None
    assert plan_for(model, MAX_BATCH + 1, list(kv.k), list(kv.v)) is None  # past MAX_BATCH: GEMM territory
    model.transformer.layers[0].mlp.act_name = "gelu_unknown"  # an op the plan cannot express
    assert plan_for(model, 1, list(kv.k), list(kv.v)) is None
    with dispatch.kernels_mode("torch"):
        assert plan_for(model, 1, list(kv.k), list(kv.v)) is None


def test_plan_rebuilt_for_new_pools(hf_dir, tmp_path):
    llm = _llm(hf_dir, tmp_path, "float32", None)
    model, kv = llm.executor.model, llm.executor.kv
    plan = plan_for(model, 1, list(kv.k), list(kv.v))
    assert plan.same_pools(list(kv.k), list(kv.v))
    other = [torch.zeros_like(p) for p in kv.k]
    assert not plan.same_pools(other, list(kv.v))
    # the stacked pools (what DecoderLM passes each step) read as the same layers, another stack does not
    assert isinstance(kv.k, torch.Tensor) and plan.same_pools(kv.k, kv.v)
    assert not plan.same_pools(torch.zeros_like(kv.k), kv.v) and not plan.same_pools(kv.k[:-1], kv.v)


def test_profiled_plan_times_every_record_and_gives_the_same_logits(hf_dir, tmp_path):
    """start_profile: each record runs as its own timed call; the logits stay the plan's bit for bit,
    every record gets a time, and the labels name the ops (linears by K x N and weight kind)."""
    llm = _llm(hf_dir, tmp_path, "float32", None)
    _generate(llm)  # the prompts' blocks now cached: both runs below prefill the same uncached tails
    plain = _generate(llm)
    plan = llm.executor.model.__dict__["_decode_plans"][len(PROMPTS)]
    plan.start_profile()
    profiled = _generate(llm)
    for a, b in zip(plain, profiled):
        assert a.output_ids == b.output_ids
        assert torch.equal(a.generation_logits, b.generation_logits)
    rows = plan.profile_rows()
    assert len(rows) == len(plan.records) and all(seconds > 0 for _, seconds in rows)
    labels = {label for label, _ in rows}
    assert {"embed", "rms_norm", "attention", "rotary", "kv_write", "act_mul"} <= labels
    # qkv (4 + 2 + 2 heads of 16), dense, fc + gate, proj, the tied lm_head (vocab 96)
    assert {"linear 64x128 fp32", "linear 64x64 fp32", "linear 64x192 fp32", "linear 96x64 fp32",
            "linear 64x96 fp32"} <= labels


def test_profile_labels_name_the_kind_of_bfloat16_scaled_int4(hf_dir, tmp_path):
    """A bf16 W4A16 engine's linears are labelled int4 whatever flag their kernel code carries (PackedWeight.code:
    SCALES_BF16 where the quads keep bfloat16 scale tiles); it printed "?" for them."""
    dtype, quant, _ = CASES["bf16_w4a16_g32_zp"]
    llm = _llm(hf_dir, tmp_path, dtype, quant)
    _generate(llm)
    plan = llm.executor.model.__dict__["_decode_plans"][len(PROMPTS)]
    plan.start_profile()
    _generate(llm)
    linears = [label for label, _ in plan.profile_rows() if label.startswith("linear")]
    assert linears and all(label.endswith(" int4") for label in linears if not label.startswith("linear 64x96")), linears
