"""A convert's resident memory (issue 27): the pieces that keep it near one rank file.

Fast: the compact GGUF reader reads every metadata field as gguf-py's reader does; row-blocked
dequantization, quantization and finiteness checks give the unblocked results. Slow (SmolLM2, each
in a fresh process): convert's peak resident memory above the post-import baseline is at most 1.5x
its largest rank file (bf16, W8A16, W4A16), and a quantized engine's prefill peak is no higher than the
bf16 engine's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf_source import write_tiny_llama
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format import packing
from bestiary.core.format.checkpoint import FINITE_CHUNK, check_finite, load_rank_weights
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import WeightsError
from bestiary.core.sources import gguf_source
from bestiary.core.sources.gguf_reader import CompactField, CompactGGUFReader


def test_compact_reader_reads_every_field_as_gguf_py(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    ours, theirs = CompactGGUFReader(path, "r"), gguf.GGUFReader(path, "r")
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert len(ours.fields[key].data) == len(field.data), key
    assert any(isinstance(f, CompactField) for f in ours.fields.values())  # the token arrays
    assert ours.data_offset == theirs.data_offset
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_bytes) == (b.name, b.tensor_type, b.n_bytes)
        assert np.array_equal(a.data, b.data)


def test_compact_reader_refuses_an_array_past_the_end(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    raw = path.read_bytes()
    cut = raw.index(b"tokenizer.ggml.tokens") + 200  # inside the token strings
    (tmp_path / "cut.gguf").write_bytes(raw[:cut])
    with pytest.raises(Exception, match="not a readable GGUF file"):
        gguf_source._read_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_row_blocked_dequantize_equals_whole(qtype, monkeypatch):
    rows = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    data = gguf.quants.quantize(rows, qtype)
    whole = gguf_source._dequantize(data, qtype)
    monkeypatch.setattr(gguf_source, "DEQUANT_ROWS", 8)  # 5 blocks, the last one short
    blocked = gguf_source._dequantize(data, qtype)
    assert blocked.dtype == np.float32 and np.array_equal(blocked, whole)
    assert np.array_equal(whole, np.asarray(gguf.quants.dequantize(data, qtype), np.float32))


def test_row_blocked_quantization_equals_whole(monkeypatch):
    w = torch.randn(37, 64)
    amax = w.abs().amax(dim=1) * 1.5
    q8, s8 = packing.quantize_int8_per_channel(w)
    q8a, s8a = packing.quantize_int8_per_channel(w, amax)
    q4, s4, z4 = packing.quantize_int4_groupwise(w, 32, True)
    c4, t4, n4 = packing.quantize_int4_groupwise(w, 32, False)
    monkeypatch.setattr(packing, "QUANT_ROWS", 8)
    for got, want in ((packing.quantize_int8_per_channel(w), (q8, s8)),
                      (packing.quantize_int8_per_channel(w, amax), (q8a, s8a)),  # per-row argument cut too
                      (packing.quantize_int8_per_channel(w, amax=amax), (q8a, s8a)),
                      (packing.quantize_int4_groupwise(w, 32, True), (q4, s4, z4)),
                      (packing.quantize_int4_groupwise(w, 32, False), (c4, t4, n4))):
        assert len(got) == len(want)
        for g, x in zip(got, want):
            assert (g is None and x is None) or torch.equal(g, x)
    assert n4 is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_finite_check_finds_the_last_bad_value(dtype):
    t = torch.zeros(2 * FINITE_CHUNK + 5, dtype=dtype)
    check_finite(t, "w")
    t[-1] = float("nan")  # in the short last chunk
    with pytest.raises(WeightsError, match=rf"^w: 1 of {2 * FINITE_CHUNK + 5} values are not finite \(first: nan\)"):
        check_finite(t, "w")


@pytest.mark.parametrize("source_kind", ["hf", "gguf"])
@pytest.mark.parametrize("quant", [None, QuantConfig(quant_algo="W8A16"), QuantConfig(quant_algo="W4A16", group_size=32)],
                         ids=["float", "W8A16", "W4A16"])
def test_row_blocked_convert_equals_whole(source_kind, quant, tmp_path, monkeypatch):
    """With blocks of 16 rows, the embedding and lm_head (96 rows) are read, cast, checked and rounded a
    block at a time (counted), and every tensor of the checkpoint equals the whole-tensor convert's."""
    from bestiary.core.convert import loader as loader_module

    if source_kind == "hf":
        src = make_tiny_llama(tmp_path)
    else:
        src = tmp_path / "tiny.gguf"
        write_tiny_llama(src)
    options = ConvertOptions(quantization=quant, weight_quantizer="rtn" if quant else None)
    whole = load_rank_weights(convert(src, tmp_path / "whole", options, show_progress=False), 0)
    calls = []
    monkeypatch.setattr(loader_module, "STREAM_ROWS", 16)
    original = loader_module.WeightsLoader.load_rows
    monkeypatch.setattr(loader_module.WeightsLoader, "load_rows",
                        lambda self, target, *a: calls.append(target.key) or original(self, target, *a))
    blocked = load_rank_weights(convert(src, tmp_path / "blocked", options, show_progress=False), 0)
    assert set(blocked) == set(whole)
    for key, tensor in whole.items():
        assert torch.equal(blocked[key], tensor), key
    assert calls.count("transformer.vocab_embedding.weight") >= 6  # 96 rows (tiny vocab) in blocks of 16 or fewer


# --- SmolLM2, each in a fresh process -----------------------------------------------------------
PROBE = r"""
import json, sys
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
what, gguf_path, out, mode = sys.argv[1:5]
import torch
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.config import QuantConfig
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
torch.set_num_threads(1)
base = status("VmRSS")
reset_peak()
if what == "convert":
    quant = {"bf16": None, "W8A16": QuantConfig(quant_algo="W8A16"), "W4A16": QuantConfig(quant_algo="W4A16")}[mode]
    options = ConvertOptions(dtype="bfloat16", quantization=quant, weight_quantizer="rtn" if quant else None)
    convert(gguf_path, out, options, show_progress=False)
    print(json.dumps({"peak_mib": status("VmHWM") - base}))
else:
    llm = LLM(out)
    reset_peak()
    llm.generate([[(i * 37) % 40000 + 100 for i in range(500)]], SamplingConfig(max_new_tokens=2, temperature=0))
    print(json.dumps({"peak_mib": status("VmHWM") - base}))
"""


def _probe(what: str, gguf_path: Path, out: Path, mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, what, str(gguf_path), str(out), mode],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory) -> dict[str, tuple[Path, float]]:
    """mode -> (checkpoint dir, convert's peak MiB above the post-import baseline)."""
    root = tmp_path_factory.mktemp("convert_memory")
    return {m: (root / m, _probe("convert", smollm2_gguf, root / m, m)) for m in ("bf16", "W8A16", "W4A16")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "W8A16", "W4A16"])
def test_convert_peak_is_at_most_1_5x_the_largest_rank_file(converted, mode):
    """Measured 2026-11-26: 127 MiB above the baseline for each of bf16 (257 MiB rank file: 0.49x),
    W8A16 (183: 0.70x) and W4A16 (122: 1.04x); before the compact reader, row blocks and freed memory
    returned: 550, 641 and 861 MiB."""
    ckpt, peak = converted[mode]
    largest = max(f.stat().st_size for f in ckpt.glob("rank*.safetensors")) / 2**20
    print(f"{mode}: convert peak {peak:.0f} MiB above baseline, largest rank file {largest:.0f} MiB")
    assert peak <= 1.5 * largest


@pytest.mark.slow
def test_quantized_prefill_peak_is_no_higher_than_bf16(converted, smollm2_gguf):
    """A 500-token prefill (peak above the post-import baseline, engine loaded): W8A16 and W4A16 hold
    packed weights and dequantize one linear at a time, so they peak below the bf16 engine."""
    peaks = {m: _probe("prefill", smollm2_gguf, converted[m][0], m) for m in ("bf16", "W8A16", "W4A16")}
    print(f"prefill peaks (MiB above baseline): {peaks}")
    assert peaks["W8A16"] <= peaks["bf16"] and peaks["W4A16"] <= peaks["bf16"]


def test_row_blocks_streams_only_plain_large_2d_copies(monkeypatch):
    """Which targets WeightsLoader.row_blocks cuts into blocks (hand-computed counts), and every
    condition that keeps a target whole."""
    from types import SimpleNamespace

    from bestiary.core.convert import loader as L
    from bestiary.core.convert.postprocess import concat_dim0, identity

    monkeypatch.setattr(L, "STREAM_ROWS", 16)

    def blocks(shape=(96, 8), source_shape=None, hook=identity, sources=("w",), tp=1, tp_dim=-1, **target_kw):
        fake = SimpleNamespace(hook_for=lambda key: hook,
                               source=SimpleNamespace(shape=lambda key: source_shape or shape))
        target = L.Target("t.weight", "t", shape, torch.float32, tp_dim, **target_kw)
        return L.WeightsLoader.row_blocks(fake, target, list(sources), tp)

    assert blocks() == 6  # 96 rows: 6 blocks of 16
    assert blocks((100, 8)) == 10  # 7, 8, 9 do not divide 100: 10 blocks of 10
    assert blocks((97, 8)) == 1  # prime: no even cut of at most 16 rows
    assert blocks((32, 8)) == 2 and blocks((31, 8)) == 1 and blocks((30, 8)) == 1  # at least 2 * STREAM_ROWS rows
    assert blocks((34, 8)) == 17  # 34 = 2 x 17: blocks of 2 rows, the smallest allowed
    assert blocks(tp=2) == 6 and blocks(tp=1, tp_dim=0) == 6  # replicated at tp 2; any tp_dim at tp 1
    for kept in (dict(sources=("a", "b")), dict(hook=concat_dim0), dict(shape=(96,)), dict(shape=(96, 8, 2)),
                 dict(source_shape=(8, 96)), dict(tp=2, tp_dim=0), dict(tp=2, tp_dim=1),
                 dict(experts=(2, 0)), dict(tp_split=(2, 1))):
        assert blocks(**kept) == 1, kept
