"""FastLLM itself (pip `ftllm`, the `flm` extra) judges bestiary's .flm reading and writing.

(a) files ftllm's exporter (torch2flm.tofile) writes at float16, int8 and int4 convert in bestiary and
    decode greedily as ftllm decodes them; (b) files bestiary writes load and decode in ftllm.
Greedy from raw ids: float16 identical over 32 tokens except from a step whose top-2 logit margin is
below 1e-3; int8 / int4: the first 16 tokens identical on at least 4 of 5 prompts (SmolLM2, `-m slow`).

On the tiny random LLaMA the int8 / int4 files are checked more strictly than by greedy tokens:
FastLLM's int8 / int4 CPU matmuls quantize their input as well (OnlineQuantization: uint8 per row, or
per group for grouped int4; the int8 kernel reads code 0 as 1), so ftllm's logits must equal
bestiary's decoding of the file plus that input quantization (flm_judge.emulated_fastllm_logits,
`activation_quant: fastllm_uint8` in the engine) to float32 rounding.

Float32 rounding is as close as two implementations get, and on a trained model it is not close
enough for greedy tokens: a uint8 input code within rounding of its boundary lands one step apart,
and the step grows through the layers (docs/fastllm.md). ftllm disagrees with itself that way when
its embedding moves by one unit in the last place (test_smollm2_ftllm_against_itself_one_ulp_apart),
so the int8 / int4 SmolLM2 criterion is an expected failure.

Files FastLLM's own `model.save()` writes (its linears merged: mergeqkv, gateup_proj) are judged at the
end: float16 greedy as above, int8 / int4 logits within the torch2flm bounds (SmolLM2: its first layers).
"""

from __future__ import annotations

import pytest

pytest.importorskip("ftllm")
transformers = pytest.importorskip("transformers")

from flm_judge import (
    agreement,
    bestiary_greedy,
    flm_eos,
    ftllm_export,
    ftllm_greedy,
    ftllm_model,
    ftllm_save,
    nudged_copy,
    truncated_copy,
    untied_smollm2,
)
from tiny_llama import make_tiny_llama

from bestiary.core.convert.export_flm import export_flm
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.config import QuantConfig
from bestiary.core.runtime.engine import Engine

TINY_PROMPTS = [[3, 17, 99, 45, 8], [1, 2, 3], [120, 64, 7, 7, 90, 11], [55], [9, 81, 33, 101]]
SMOL_PROMPTS = [[1, 504, 3458, 314, 5549, 30], [1, 2683, 314, 253, 1692], [1, 1978, 549, 260, 1345, 282],
                [1, 9690, 2286, 28, 3465], [1, 30, 3126, 2911, 3758, 1036]]
LOGIT_SCALE = 20.0
QUANT = {"float16": None, "int8": QuantConfig(quant_algo="W8A16", activation_quant="fastllm_uint8"),
         "int4": QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=True,
                             activation_quant="fastllm_uint8", activation_group_size=128)}
# SmolLM2's 576 inputs are not a multiple of 128: bestiary writes g128 as g64 there (FastLLM miscomputes a
# partial last group) and FastLLM then quantizes those inputs per 64; g64 everywhere computes the same
SMOL_QUANT = {**QUANT, "int4": QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True,
                                           activation_quant="fastllm_uint8", activation_group_size=64)}


def check(engine, ft, prompts, dtype: str, eos: tuple[int, ...] = ()) -> list[str]:
    """The agreement of every prompt; asserts the issue's criteria."""
    steps = 32 if dtype == "float16" else 16
    results = []
    for prompt in prompts:
        ours, margins = bestiary_greedy(engine, prompt, steps)
        results.append(agreement(ours, margins, ftllm_greedy(ft, prompt, steps), steps, eos))
    text = [str(r) for r in results]
    if dtype == "float16":
        assert all(r.identical or r.near_tie for r in results), text
    else:
        assert sum(r.identical for r in results) >= 4, text
    return text


def ftllm_file_in_bestiary(hf_dir, tmp, dtype, prompts, with_tokenizer=False):
    flm = ftllm_export(hf_dir, tmp / f"ft_{dtype}.flm", dtype, with_tokenizer)
    convert(flm, tmp / f"ck_{dtype}", show_progress=False)
    return check(Engine.load(tmp / f"ck_{dtype}"), ftllm_model(flm), prompts, dtype, flm_eos(flm))


def bestiary_file_in_ftllm(hf_dir, tmp, dtype, prompts, quant=QUANT):
    ck = tmp / f"ours_{dtype}"
    options = ConvertOptions(dtype="float16", quantization=quant[dtype],
                             weight_quantizer="rtn" if quant[dtype] else None)
    convert(hf_dir, ck, options, show_progress=False)
    flm = export_flm(ck, tmp / f"ours_{dtype}.flm", show_progress=False)
    return check(Engine.load(ck), ftllm_model(flm), prompts, dtype, flm_eos(flm))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random LLaMA whose lm_head is scaled up: a random model's next-token logits are nearly
    flat, and FastLLM's int8 / int4 CPU matmuls quantize the activations too (noise ~1e-2), so
    greedy steps are compared where they are decided by more than that noise, as in a trained model."""
    import torch

    hf = make_tiny_llama(tmp_path_factory.mktemp("tiny"), intermediate_size=128, vocab_size=128)
    model = transformers.LlamaForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(hf)
    return hf


def test_float16_files_decode_the_same_both_ways(tiny, tmp_path):
    ftllm_file_in_bestiary(tiny, tmp_path, "float16", TINY_PROMPTS)
    bestiary_file_in_ftllm(tiny, tmp_path, "float16", TINY_PROMPTS)


def int4_files(tiny, tmp_path) -> list[tuple[str, object, int | None]]:
    """(label, .flm, input group of FastLLM's online quantization) of ftllm's and bestiary's int4 files."""
    ck = tmp_path / "ours"
    convert(tiny, ck, ConvertOptions(quantization=QUANT["int4"], weight_quantizer="rtn"), show_progress=False)
    return [("ftllm int4 (per row)", ftllm_export(tiny, tmp_path / "ft_int4.flm", "int4", False), None),
            ("ftllm int4g64", ftllm_export(tiny, tmp_path / "ft_int4g64.flm", "int4g64", False), 64),
            ("bestiary int4g128", export_flm(ck, tmp_path / "ours_g.flm", show_progress=False), 128),
            ("bestiary int4 (per row)", export_flm(ck, tmp_path / "ours_r.flm", "int4", show_progress=False), None)]


def test_int4_files_compute_in_ftllm_what_bestiary_reads(tiny, tmp_path):
    from flm_judge import emulated_fastllm_logits, ftllm_logits

    from bestiary.core.sources import open_source

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny).float().eval()
    for label, flm, group in int4_files(tiny, tmp_path):
        weights = open_source(flm).weights
        values = {k: weights.load(k).float() for k in weights.keys()}  # noqa: SIM118 - a WeightSource
        ft = ftllm_model(flm)
        for prompt in TINY_PROMPTS:
            ref = emulated_fastllm_logits(hf, values, prompt, group)
            got = ftllm_logits(ft, prompt, 128)
            assert (got - ref).abs().max() < 1e-4 * ref.abs().max(), (label, prompt, float((got - ref).abs().max()))


def test_int8_files_compute_in_ftllm_what_bestiary_computes(tiny, tmp_path):
    """ftllm's int8 file converted (activation_quant fastllm_uint8, code 0 read as 1): the engine's
    logits equal ftllm's to float32 rounding; one prompt may differ by an input code that float32
    rounding put on the other side of its boundary (module doc), and stays close."""
    import parity
    from flm_judge import ftllm_logits

    flm = ftllm_export(tiny, tmp_path / "ft_int8.flm", "int8", False)
    convert(flm, tmp_path / "ck", show_progress=False)
    engine, ft = Engine.load(tmp_path / "ck"), ftllm_model(flm)
    diffs = []
    for prompt in TINY_PROMPTS:
        ours = parity.EngineRunner(engine).feed(prompt)[-1].float()
        theirs = ftllm_logits(ft, prompt, 128)
        diffs.append(float((ours - theirs).abs().max() / theirs.abs().max()))
    assert sum(d < 1e-4 for d in diffs) >= 4 and max(diffs) < 0.05, diffs


def test_int4_engines_with_activation_quant_compute_what_ftllm_computes(tiny, tmp_path):
    """activation_quant fastllm_uint8 (set by converting ftllm's int4 files, chosen for bestiary's own):
    the engine's logits equal ftllm's to float32 rounding, and greedy decode agrees both ways."""
    import json

    import parity
    from flm_judge import ftllm_logits

    for label, flm, group in int4_files(tiny, tmp_path):
        ck = tmp_path / f"ck_{flm.stem}"
        convert(flm, ck, show_progress=False)
        quant = json.loads((ck / "config.json").read_text())["quantization"]
        expected = None if group == 128 else group  # the tiny rows hold <= 128 inputs: one group a row
        assert (quant["activation_quant"], quant["activation_group_size"]) == ("fastllm_uint8", expected), label
        engine, ft = Engine.load(ck), ftllm_model(flm)
        for prompt in TINY_PROMPTS:
            ours = parity.EngineRunner(engine).feed(prompt)[-1].float()
            theirs = ftllm_logits(ft, prompt, 128)
            assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max(), (label, prompt)
    ftllm_file_in_bestiary(tiny, tmp_path, "int4", TINY_PROMPTS)
    bestiary_file_in_ftllm(tiny, tmp_path, "int4", TINY_PROMPTS)


def test_activation_quant_needs_weight_only_quantization(tmp_path):
    from bestiary.core.format.errors import ConfigError
    from bestiary.core.quant.modes import linear_quant_of

    assert linear_quant_of(QUANT["int4"]).act_group == 128
    with pytest.raises(ConfigError, match="activation_quant"):
        linear_quant_of(QuantConfig(quant_algo="FP8", activation_quant="fastllm_uint8"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return untied_smollm2(tmp_path_factory.mktemp("smollm2") / "hf")


CHAOTIC = pytest.mark.xfail(strict=False, reason=(
    "float32 rounding decides some uint8 input codes and the step grows (docs/fastllm.md): ftllm "
    "against itself one ulp apart agrees on 1 (int4) / 2 (int8) of 5 prompts"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", pytest.param("int8", marks=CHAOTIC),
                                   pytest.param("int4", marks=CHAOTIC)])
def test_smollm2_both_ways(smollm2, tmp_path, dtype):
    """SmolLM2-135M (untied) at each dtype, both ways (minutes per dtype on 2 cores)."""
    ftllm_file_in_bestiary(smollm2, tmp_path, dtype, SMOL_PROMPTS, with_tokenizer=True)
    bestiary_file_in_ftllm(smollm2, tmp_path, dtype, SMOL_PROMPTS, quant=SMOL_QUANT)


@pytest.mark.slow
def test_smollm2_ftllm_against_itself_one_ulp_apart(smollm2, tmp_path):
    """The control for the xfail above: ftllm's own int4 file, and the same file with every embedding
    value moved by one unit in the last place, do not meet the int4 criterion against each other,
    while the same nudge leaves float16 greedy tokens as they were."""
    def greedy(flm):
        ft = ftllm_model(flm)
        return [ftllm_greedy(ft, p, 16) for p in SMOL_PROMPTS]

    def identical(flm):
        a, b = greedy(flm), greedy(nudged_copy(flm, flm.with_suffix(".ulp.flm")))
        return sum(x == y for x, y in zip(a, b))

    assert identical(ftllm_export(smollm2, tmp_path / "ft_float16.flm", "float16", False)) == 5
    assert identical(ftllm_export(smollm2, tmp_path / "ft_int4.flm", "int4", False)) < 4


# ---- files FastLLM's model.save() writes (merged mergeqkv / gateup_proj; core.sources.flm_merged) ----------

WEIGHT_CODE_0 = pytest.mark.xfail(strict=True, reason=(
    "FastLLM's AVX2 int8 dot (DotU8U8) reads weight code 0 as 1 while its zero-point correction sums the "
    "true codes: each output gains s_w s_x sum over its code-0 weights of (q_x - 128); model.save()'s "
    "min/max rows put code 0 at every row's minimum (torch2flm's (-m, m) rows never hold code 0), and "
    "activation_quant fastllm_uint8 does not add that term (docs/fastllm.md)"))


def logits_rel_diffs(engine, ft, prompts, vocab: int) -> list[float]:
    """max |engine - ftllm| / max |ftllm| of the next-token logits after each prompt."""
    import parity
    from flm_judge import ftllm_logits

    out = []
    for prompt in prompts:
        ours = parity.EngineRunner(engine).feed(prompt)[-1].float()
        theirs = ftllm_logits(ft, prompt, vocab)
        out.append(float((ours - theirs).abs().max() / theirs.abs().max()))
    return out


def within_torch2flm_bounds(dtype: str, diffs: list[float]) -> bool:
    """docs/fastllm.md's logit bounds for torch2flm files: int4 every prompt to 1e-4 of the logits'
    range; int8 at least 4 of 5 prompts to 1e-4 and none beyond 0.05."""
    if dtype == "int4":
        return max(diffs) < 1e-4
    return sum(d < 1e-4 for d in diffs) >= len(diffs) - 1 and max(diffs) < 0.05


@pytest.fixture(scope="module")
def tiny_fp16_hf(tmp_path_factory):
    """The tiny LLaMA as float16 safetensors with a tokenizer: what ftllm's HF loader reads."""
    from tiny_llama import write_tiny_tokenizer

    hf = make_tiny_llama(tmp_path_factory.mktemp("tiny16"), intermediate_size=128, vocab_size=128)
    transformers.LlamaForCausalLM.from_pretrained(hf).half().save_pretrained(hf)
    write_tiny_tokenizer(hf)
    return hf


@pytest.mark.parametrize("dtype", ["float16", "int4", pytest.param("int8", marks=WEIGHT_CODE_0)])
def test_model_save_files_of_the_tiny_llama(tiny_fp16_hf, tmp_path, dtype):
    """ftllm's model.save() of an HF dir: float16 splits back to the HF tensors to the bit; int8 / int4
    files convert and compute ftllm's logits within the bounds of torch2flm's files."""
    import torch
    from safetensors.torch import load_file

    from bestiary.core.sources import open_source
    from bestiary.core.sources.flm_reader import read_flm

    flm = tmp_path / f"saved_{dtype}.flm"
    ftllm_save(tiny_fp16_hf, flm, dtype)
    assert "model.layers.0.self_attn.mergeqkv.weight" in read_flm(flm).tensors
    if dtype == "float16":
        hf, weights = load_file(tiny_fp16_hf / "model.safetensors"), open_source(flm).weights
        assert sorted(weights.keys()) == sorted(hf)
        assert all(torch.equal(weights.load(k).to(hf[k].dtype), hf[k]) for k in hf)
        return
    # float32 compute, as FastLLM's CPU path (the file's model info says float16: the HF dir's torch_dtype)
    convert(flm, tmp_path / "ck", ConvertOptions(dtype="float32"), show_progress=False)
    diffs = logits_rel_diffs(Engine.load(tmp_path / "ck"), ftllm_model(flm), TINY_PROMPTS, 128)
    assert within_torch2flm_bounds(dtype, diffs), diffs


SAVED_DEPTH = 2  # SmolLM2 layers kept for int8 / int4 logits (docs/fastllm.md: deeper, rounding decides codes)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "int4", pytest.param("int8", marks=WEIGHT_CODE_0)])
def test_smollm2_model_save_files(smollm2, tmp_path, dtype):
    """SmolLM2-135M (untied) saved by ftllm's model.save() (one HF load each): float16 converts and decodes
    greedily as ftllm decodes (32 tokens from raw ids, near-ties excepted); int8 / int4 logits of the
    file's first SAVED_DEPTH layers (the file's own tensor bytes) within torch2flm's bounds."""
    flm = tmp_path / f"saved_{dtype}.flm"
    ft = ftllm_save(smollm2, flm, dtype)
    if dtype == "float16":  # the file holds what ftllm computes with: its in-memory model is the judge
        convert(flm, tmp_path / "ck", ConvertOptions(dtype="float32"), show_progress=False)  # float32 compute: CPU-fast
        check(Engine.load(tmp_path / "ck"), ft, SMOL_PROMPTS, dtype, flm_eos(flm))
        return
    # int4 (min, max) pairs are re-derived when read back (LowBitConfig type 1: min = -s z): ftllm running
    # the file, not its in-memory model, is what the file means
    part = truncated_copy(flm, tmp_path / f"saved_{dtype}_L{SAVED_DEPTH}.flm", SAVED_DEPTH)
    convert(part, tmp_path / "ck", ConvertOptions(dtype="float32"), show_progress=False)
    diffs = logits_rel_diffs(Engine.load(tmp_path / "ck"), ftllm_model(part), SMOL_PROMPTS, 49152)
    assert within_torch2flm_bounds(dtype, diffs), diffs
