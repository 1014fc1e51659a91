"""Real-size synthetic models for `bestiary bench --shape` (core.bench.synthetic), on the tiny shape.

The tiny shape goes source -> engines -> GGUFs once per module (a few seconds): the source is what
its config says and reloads equal in transformers; every artifact is made once (a second call
reuses it: mtime unchanged); the GGUFs, read back by bestiary's own GGUF source, dequantize to the
source's weights within the quantization error of their type (q / k permutation undone); the
CLI's one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bestiary.core.bench import synthetic as syn
from bestiary.core.cli.main import main
from bestiary.core.format.errors import BestiaryError

gguf = pytest.importorskip("gguf")
SHAPE = syn.SHAPES["tiny"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = tmp_path_factory.mktemp("synthetic")
    source = syn.synthetic_source(SHAPE, cache)
    engines = syn.synthetic_engines(SHAPE, list(syn.MODES), cache)
    ggufs = syn.synthetic_gguf(SHAPE, list(syn.GGUF_TYPES), cache)
    return cache, source, engines, ggufs


def source_weights(source: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(source / "model.safetensors"))


def test_source_is_what_its_config_says(made):
    _, source, _, _ = made
    config = json.loads((source / "config.json").read_text())
    assert config == SHAPE.hf_config()
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 2, 320)
    weights = source_weights(source)
    assert {k: tuple(v.shape) for k, v in weights.items()} == dict(SHAPE.tensors())
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    for key, w in weights.items():
        if key.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), key
        else:  # N(0, 0.02^2): the sample std of >= 16k draws within 5%
            assert abs(w.float().std().item() - syn.STD) < 0.05 * syn.STD, key
            assert abs(w.float().mean().item()) < 0.1 * syn.STD, key
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"][:64, :64],
                           weights["model.layers.1.mlp.up_proj.weight"][:64, :64])  # seeded per tensor


def test_source_reloads_equal_in_transformers(made):
    transformers = pytest.importorskip("transformers")
    _, source, _, _ = made
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16)
    assert type(model).__name__ == "LlamaForCausalLM"
    weights = source_weights(source)
    state = model.state_dict()
    assert sorted(state) == sorted(weights)
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_source_is_the_same_every_time(made, tmp_path):
    """Another cache makes the same bytes: the weights are seeded, not drawn anew."""
    _, source, _, _ = made
    again = syn.synthetic_source(SHAPE, tmp_path)
    assert again != source
    assert (again / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_made_once(made):
    """A second call reuses every artifact: same paths, files not written again (mtime_ns unchanged)."""
    cache, source, engines, ggufs = made
    files = [source / "model.safetensors", *(e / "config.json" for e in engines.values()), *ggufs.values()]
    before = [f.stat().st_mtime_ns for f in files]
    assert syn.synthetic_source(SHAPE, cache) == source
    assert syn.synthetic_engines(SHAPE, list(syn.MODES), cache) == engines
    assert syn.synthetic_gguf(SHAPE, list(syn.GGUF_TYPES), cache) == ggufs
    assert [f.stat().st_mtime_ns for f in files] == before
    assert not [p for p in source.parent.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_engines_hold_their_modes_and_generate(made):
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    _, _, engines, _ = made
    algos = {}
    for mode, engine in engines.items():
        config = json.loads((engine / "config.json").read_text())
        algos[mode] = config["pretrained_config"]["quantization"]["quant_algo"]
        assert config["build_config"]["max_seq_len"] == SHAPE.max_position_embeddings
        llm = LLM(str(engine))
        try:
            (done,) = llm.generate([[1, 5, 7, 9]], SamplingConfig(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        finally:
            llm.close()
        assert len(done.output_ids) == 3 and all(0 <= t < SHAPE.vocab_size for t in done.output_ids)
    assert algos == {"bf16": None, "w8a16": "W8A16", "w4a16": "W4A16", "w8a8": "W8A16", "w4a8": "W4A16"}
    for mode in ("w8a8", "w4a8"):
        assert json.loads((engines[mode] / "config.json").read_text())["pretrained_config"]["quantization"][
            "activation_quant"] == "int8"


def gguf_types(path: Path) -> dict[str, str]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors}


def test_gguf_types_are_llama_cpps(made):
    _, _, _, ggufs = made
    q8, q41 = gguf_types(ggufs["Q8_0"]), gguf_types(ggufs["Q4_1"])
    assert {q8[n] for n in q8 if not n.endswith("norm.weight")} == {"Q8_0"}
    assert {q8[n] for n in q8 if n.endswith("norm.weight")} == {"F32"}
    assert q41["token_embd.weight"] == "Q4_1" and q41["output.weight"] == "Q8_0"
    assert q41["blk.1.ffn_down.weight"] == q41["blk.0.attn_q.weight"] == "Q4_1"
    assert len(q8) == len(SHAPE.tensors())


def block_bound(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Per weight, the most a round-to-nearest of its 32-block can move it: Q8_0 scale d = absmax / 127,
    error <= d / 2; Q4_1 d = (max - min) / 15, error <= d / 2; plus the fp16 rounding of d (and min)."""
    blocks = w.reshape(-1, 32)  # [n / 32, 32]
    if qtype == "Q8_0":
        d = blocks.abs().amax(1, keepdim=True) / 127
        bound = d / 2 + 127 * d * 2**-11
    else:
        lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
        d = (hi - lo) / 15
        bound = d / 2 + 15 * d * 2**-11 + lo.abs() * 2**-11
    return (bound * 1.01 + 1e-7).expand_as(blocks).reshape(w.shape)


@pytest.mark.parametrize("qtype", syn.GGUF_TYPES)
def test_gguf_reads_back_as_the_source(made, qtype):
    """bestiary's GGUF source gives back the HF names and shapes, and every weight within its block's
    quantization error of the source (q / k permuted back: a row order left permuted misses by ~STD)."""
    from bestiary.core.sources.gguf_source import open_gguf

    _, source, _, ggufs = made
    weights = source_weights(source)
    src = open_gguf(ggufs[qtype])
    assert sorted(src.weights.keys()) == sorted(weights)
    config = src.hf_config
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert config[field] == SHAPE.hf_config()[field], field
    types = gguf_types(ggufs[qtype])
    for key, w in weights.items():
        got, want = src.weights.load(key), w.float()
        stored = types[syn.gguf_name(key)]
        if stored == "F32":
            assert torch.equal(got, want), key
            continue
        err = (got - want).abs()
        assert (err <= block_bound(want, stored)).all(), (key, err.max().item())
    q = weights["model.layers.0.self_attn.q_proj.weight"].float()
    permuted = torch.from_numpy(syn.gguf_permute(q.numpy(), SHAPE.num_attention_heads))
    assert (src.weights.load("model.layers.0.self_attn.q_proj.weight") - permuted).abs().max() > 5 * syn.STD


def test_gguf_permute_is_llama_cpps():
    """Within each head the rotate-half order (x0 .. x_{d/2-1}, y0 .. y_{d/2-1}) becomes pairs (x0, y0, x1, y1, ...)."""
    import numpy as np

    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of d = 4: rows 0..3, 4..7
    assert syn.gguf_permute(rows, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_llama3_rope_factors_read_back_as_the_published_scaling(tmp_path):
    """The 3B shape's rope_freqs (llama.cpp's llama3 factors) reads back, in bestiary's GGUF source, as the
    rope_scaling the shape's config has: checked on a 1-layer copy of its attention shape."""
    from bestiary.core.sources.gguf_source import open_gguf

    big = syn.SHAPES["llama-3.2-3b"]
    small = syn.Shape("rope-check", big.hidden_size // 8, 1, big.num_attention_heads // 8, big.num_key_value_heads // 8,
                      64, 320, rope_theta=big.rope_theta, max_position_embeddings=big.max_position_embeddings,
                      tie_word_embeddings=True, rope_scaling=big.rope_scaling)
    assert small.head_dim == big.head_dim == 128
    path = syn.synthetic_gguf(small, ["Q8_0"], tmp_path)["Q8_0"]
    config = open_gguf(path).hf_config
    assert config["rope_scaling"] == syn.LLAMA3_ROPE and config["rope_theta"] == big.rope_theta
    assert "output.weight" not in gguf_types(path)  # tied: llama.cpp uses token_embd


def test_real_shapes_are_the_published_configs():
    tiny_llama, llama32, llama2 = (syn.SHAPES[n] for n in ("tinyllama-1.1b", "llama-3.2-3b", "llama-2-7b"))
    assert 1.09e9 < tiny_llama.params() < 1.11e9  # TinyLlama-1.1B: 1,100,048,384
    assert tiny_llama.params() == 1_100_048_384
    assert llama32.params() == 3_212_749_824  # Llama-3.2-3B (tied)
    assert llama2.params() == 6_738_415_616  # Llama-2-7b
    assert llama32.hf_config()["rope_scaling"]["factor"] == 32.0 and llama32.head_dim == 128


def test_not_enough_disk_is_one_line(tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(syn.shutil, "disk_usage", lambda _: usage(1 << 40, 1 << 40, 2 << 30))
    with pytest.raises(BestiaryError, match=r"2\.0 GiB free; the tinyllama-1.1b bf16 source needs about 2\.0 GiB"):
        syn.synthetic_source(syn.SHAPES["tinyllama-1.1b"], tmp_path)
    assert not any(tmp_path.rglob("*.safetensors"))


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(["bench", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--shape", "llama-9b"], "--shape llama-9b: unknown shape; expected one of tinyllama-1.1b, llama-3.2-3b, "
                              "llama-2-7b, tiny"),
    (["--shape", "tiny", "--modes", "fp8"], "--modes fp8: unknown engine mode; expected some of bf16, w8a16, w4a16, w8a8, w4a8"),
    (["--shape", "tiny", "--gguf_types", "Q4_K"], "--gguf_types Q4_K: expected some of Q8_0, Q4_1 "
                                                   "(gguf-py has no K-quant quantizer)"),
    ([], "bench: give --engine_dir ENGINE ... or --shape NAME (a synthetic model)"),
    (["--shape", "tiny", "--workloads", "rewrite"], "--workloads rewrite: the --shape tiny engines have no "
                                                     "tokenizer (random weights, token-id prompts); leave rewrite out"),
    (["--shape", "tiny", "--reference", "hf"], "--reference hf: expected engine or a --compare peer (llama.cpp)"),
])
def test_cli_one_line_errors(argv, message, capsys, tmp_path):
    code, err = run_cli([*argv, "--cache_dir", str(tmp_path)], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"error: {message}"], err
    assert not list(tmp_path.iterdir())  # refused before anything was made


def test_cli_not_enough_disk_is_one_line(capsys, tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(syn.shutil, "disk_usage", lambda _: usage(1 << 40, 1 << 40, 1 << 20))
    code, err = run_cli(["--shape", "tiny", "--gguf_types", "--cache_dir", str(tmp_path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "0.0 GiB free; --shape tiny (what is not made yet) needs about 0.0 GiB (+ 1.0 GiB margin)" in err
    assert not list(tmp_path.iterdir())


def test_cli_missing_llama_cpp_is_one_line(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    code, err = run_cli(["--shape", "tiny", "--cache_dir", str(tmp_path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--gguf_types Q8_0 Q4_1: llama-cpp-python is not installed" in err


def test_cli_shape_benches_the_made_engines(made, capsys):
    """--shape tiny (no GGUF) makes nothing new in a warm cache and benches its three engines; with every
    artifact made, a deleted source stays deleted (it was made again, 6 GiB at 3B, before each run)."""
    cache, source, engines, _ = made
    argv = ["bench", "--shape", "tiny", "--cache_dir", str(cache), "--gguf_types", "--workloads", "decode",
            "--new_tokens", "2", "--repeats", "1", "--bandwidth_mib", "0", "--json"]
    aside = source.with_name("source.aside")
    source.rename(aside)
    try:
        code = main(argv)
        assert not source.exists()
    finally:
        aside.rename(source)
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [r["label"] for r in json.loads(out)["rows"]]
    assert rows == [f"bestiary {engines[m].name}" for m in syn.DEFAULT_MODES]
    assert err.count(": reused,") == 3 and ": made," not in err and "source: not needed" in err


SHARP_STD = 0.1  # weights large enough that attention is far from uniform: RoPE and the q / k order decide


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """The tiny shape's source and GGUFs with weights of std SHARP_STD (a cache key of their own). At 0.02 the
    tiny model's attention scores are near 0, so a GGUF with q / k rows left unpermuted runs almost as the
    source does; at 0.1 llama.cpp on such a file misses transformers on the source by ~4x the logits'
    spread (4.45 against a std of 1.07 at Q8_0), on the right file by 0.12 (Q8_0's rounding)."""
    cache = tmp_path_factory.mktemp("sharp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(syn, "STD", SHARP_STD)
        return syn.synthetic_source(SHAPE, cache), syn.synthetic_gguf(SHAPE, list(syn.GGUF_TYPES), cache)


@pytest.mark.parametrize("qtype", syn.GGUF_TYPES)
def test_llama_cpp_runs_the_gguf_as_transformers_runs_its_weights(sharp, qtype):
    """llama.cpp's logits on the GGUF are transformers' on the weights the GGUF holds (dequantized by
    bestiary's GGUF source, float32), and at Q8_0 near transformers' on the source itself (no bestiary
    reader between): the file is the model llama.cpp's converter would have written (q / k order, RoPE,
    norms, vocabulary). llama.cpp quantizes the activations of a quantized matmul too (Q8_0 / Q8_1
    blocks), hence tolerances relative to the logits' spread."""
    llama_cpp = pytest.importorskip("llama_cpp")
    transformers = pytest.importorskip("transformers")
    from bestiary.core.sources.gguf_source import open_gguf

    source, ggufs = sharp
    src = open_gguf(ggufs[qtype])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.load_state_dict({k: src.weights.load(k) for k in src.weights.keys()}, strict=True)  # noqa: SIM118
    prompt = [1, 300, 17, 45, 99, 260, 7, 311]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]  # [tokens, vocab]
    llm = llama_cpp.Llama(model_path=str(ggufs[qtype]), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(prompt)
        got = torch.from_numpy(llm.scores[: len(prompt)].copy()).float()  # [tokens, vocab]
    finally:
        llm.close()
    assert got.shape == want.shape
    assert (got - want).abs().max() < 0.15 * want.std(), ((got - want).abs().max(), want.std())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if qtype == "Q8_0":  # against the source's own weights: Q8_0 rounding only (measured 0.12 / 1.07)
        with torch.no_grad():
            exact = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)(
                torch.tensor([prompt])).logits[0]  # [tokens, vocab]
        assert (got - exact).abs().max() < 0.3 * exact.std(), ((got - exact).abs().max(), exact.std())


# MiB of the artifacts made on 2026-11-29 (du -sm; docs/bench.md#real-sizes): the disk check's estimate was 10% low for
# a tied model's quantized engines (the engine holds the lm_head quantized beside the bf16 embedding)
MADE_MIB = {("tinyllama-1.1b", "w8a16"): 1113, ("tinyllama-1.1b", "w4a16"): 634, ("tinyllama-1.1b", "Q4_1"): 684,
            ("llama-3.2-3b", "bf16"): 6128, ("llama-3.2-3b", "w8a16"): 3818, ("llama-3.2-3b", "w4a16"): 2332,
            ("llama-3.2-3b", "Q8_0"): 3259, ("llama-3.2-3b", "Q4_1"): 2083, ("llama-2-7b", "w4a16"): 3500,
            ("llama-2-7b", "Q4_1"): 4073}


@pytest.mark.parametrize(("shape", "what"), list(MADE_MIB))
def test_estimated_bytes_are_the_made_files(shape, what):
    estimate = syn.estimated_bytes(syn.SHAPES[shape], what) / 2**20
    assert abs(estimate - MADE_MIB[shape, what]) <= 0.005 * MADE_MIB[shape, what]
