"""Importing HF AWQ / GPTQ checkpoints (core.convert.import_prequantized, core.quant.hf_formats).

The int32 words of each format are written here by hand (golden tests), and the tiny
checkpoints are packed by this file's own packers, written from the format descriptions
(not the library's code), so a packer and an unpacker cannot share a bug. The float
reference of every imported engine is the quantized weight dequantized here from the
codes this file chose: w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n].
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from parity import EngineRunner, reassemble_checkpoint
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.errors import BestiaryError, ConfigError, WeightsError
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.quant import hf_formats
from bestiary.core.quant.apply import quantized_linears, set_compute_dtype
from bestiary.core.quant.modes import LinearQuant
from bestiary.core.quant.slot import WeightOnlySlot
from bestiary.core.runtime.engine import Engine

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ: nibble j of a word holds column ORDER[j]


def i32(words: list[int]) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 tensor a checkpoint stores."""
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


# --- golden words, written by hand -------------------------------------------------------------
def test_awq_word_golden():
    # columns 0..7 hold codes 1..8: nibbles (low first) hold columns 0,2,4,6,1,3,5,7 -> 1,3,5,7,2,4,6,8
    word = 0x86427531
    assert hf_formats.unpack_awq(i32([word]).view(1, 1)).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    # two words in a row: the second covers columns 8..15; codes 15 and 0 (the sign bit set)
    words = i32([0xF0000000, 0x0000000F]).view(1, 2)
    assert hf_formats.unpack_awq(words).tolist() == [[0] * 7 + [15] + [15] + [0] * 7]


def test_gptq_words_golden():
    # qweight [K/8, N]: nibble j of row r is in-feature 8r + j (one column: codes 1..8, then 9..15, 0)
    qweight = i32([0x87654321, 0x0FEDCBA9]).view(2, 1)
    assert hf_formats.unpack_gptq_qweight(qweight).flatten().tolist() == list(range(1, 16)) + [0]
    # qweight with two columns: each column its own words
    two = i32([0x11111111, 0x22222222]).view(1, 2)
    assert hf_formats.unpack_gptq_qweight(two).tolist() == [[1, 2]] * 8
    # qzeros [groups, N/8]: nibble j of word c is column 8c + j, in order
    assert hf_formats.unpack_gptq_qzeros(i32([0x76543210]).view(1, 1)).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_act_order_perm_golden():
    g_idx = torch.tensor([1, 0, 1, 0, 2, 2])  # groups of 2: features {1, 3}, {0, 2}, {4, 5}
    assert hf_formats.act_order_perm(g_idx, 2).tolist() == [1, 3, 0, 2, 4, 5]
    assert hf_formats.act_order_perm(torch.zeros(6, dtype=torch.int32), -1).tolist() == list(range(6))
    with pytest.raises(ValueError, match="not 2 input features each"):
        hf_formats.act_order_perm(torch.tensor([0, 0, 0, 1, 1, 2]), 2)


def test_gptq_layer_canonical_golden():
    """A whole GPTQ v1 layer, K 64, N 8, two groups of 32 interleaved (act-order), dequantized by hand."""
    codes = [[(k * 3 + n) % 16 for n in range(8)] for k in range(64)]  # q[k][n]
    qweight = i32([sum(codes[8 * r + j][n] << (4 * j) for j in range(8)) for r in range(8) for n in range(8)])
    zeros = [[8, 7, 6, 5, 9, 10, 11, 1], [2, 3, 4, 5, 6, 7, 8, 9]]  # z[g][n]
    qzeros = i32([sum((zeros[g][j] - 1) << (4 * j) for j in range(8)) for g in range(2)]).view(2, 1)
    scales = torch.tensor([[0.5 + n for n in range(8)], [0.25 * (n + 1) for n in range(8)]])
    g_idx = torch.tensor([k % 2 for k in range(64)])  # even features: group 0, odd ones: group 1
    q = hf_formats.unpack_gptq_qweight(qweight.view(8, 8))
    z = hf_formats.unpack_gptq_qzeros(qzeros).float() + 1
    perm = hf_formats.act_order_perm(g_idx, 32)
    assert perm.tolist() == list(range(0, 64, 2)) + list(range(1, 64, 2))
    c = hf_formats.to_canonical(q, z, scales, perm, 32)
    assert c.scales.shape == (8, 2) and c.codes.shape == (8, 64)
    expected = torch.tensor([[(codes[k][n] - zeros[k % 2][n]) * scales[k % 2][n].item() for k in range(64)]
                             for n in range(8)])  # [N, K] in the source feature order
    canonical = (c.codes.float() - c.zeros.repeat_interleave(32, 1)) * c.scales.repeat_interleave(32, 1)
    assert torch.equal(canonical[:, perm.argsort()], expected)  # canonical feature j is source feature perm[j]


def test_gptq_v1_zero_of_zero_reads_back_as_16():
    """v1 stores z - 1; a zero point of 0 is stored as nibble 15 and the kernels read 16."""
    stored = hf_formats.unpack_gptq_qzeros(i32([0xFFFFFFFF]).view(1, 1)).float() + 1
    assert stored.tolist() == [[16.0] * 8]


def test_canonical_groups():
    assert [hf_formats.canonical_group(g) for g in (-1, 32, 64, 128, 256, 96)] == [128, 32, 64, 128, 128, 32]
    with pytest.raises(ValueError):
        hf_formats.canonical_group(48)


# --- tiny checkpoints in each format -------------------------------------------------------------
def _to_i32(x: torch.Tensor) -> torch.Tensor:
    return ((x + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C/8]: nibble j of word c holds column 8c + ORDER[j]."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for c in range(v.shape[1] // 8):
        for j in range(8):
            out[:, c] |= v[:, 8 * c + ORDER[j]].long() << (4 * j)
    return _to_i32(out)


def pack_sequential_cols(v: torch.Tensor) -> torch.Tensor:
    """[R, C] -> int32 [R, C/8]: nibble j of word c holds column 8c + j (GPTQ qzeros)."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for c in range(v.shape[1] // 8):
        for j in range(8):
            out[:, c] |= v[:, 8 * c + j].long() << (4 * j)
    return _to_i32(out)


def pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] -> int32 [K/8, N]: nibble j of row r holds in-feature 8r + j."""
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for r in range(q.shape[0] // 8):
        for j in range(8):
            out[r] |= q[8 * r + j].long() << (4 * j)
    return _to_i32(out)


def quantize_by_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """w [N, K] -> (q [K, N], z [groups, N], s [groups, N]): asymmetric min/max per group, z >= 1."""
    wt = w.t().float()
    s, z = torch.empty(groups, w.shape[0]), torch.empty(groups, w.shape[0])
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        s[g] = ((hi - lo) / 15).clamp(min=1e-6)
        z[g] = torch.round(-lo / s[g]).clamp(1, 15)
    q = torch.clamp(torch.round(wt / s[g_idx]) + z[g_idx], 0, 15)
    return q.long(), z.long(), s


PROJ = {"self_attn.q_proj": "attn_in", "self_attn.k_proj": "attn_in", "self_attn.v_proj": "attn_in",
        "self_attn.o_proj": "o", "mlp.gate_proj": "mlp_in", "mlp.up_proj": "mlp_in", "mlp.down_proj": "down"}


def g_idx_for(k: int, group: int, order: str | None, gen: torch.Generator, halves: int = 1) -> torch.Tensor:
    """Trivial g_idx (k // G), or act-order: g_idx[perm[i]] = i // G for a random perm (within
    each of `halves` blocks of features when `order` is "local")."""
    g = k if group == -1 else group
    if order is None:
        return torch.arange(k) // g
    block = k // halves if order == "local" else k
    perm = torch.cat([torch.randperm(block, generator=gen) + b * block for b in range(k // block)])
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // g
    return g_idx


def make_quantized(tmp_path: Path, method: str, group: int, act_order: dict | None = None,
                   v1: bool = True, **overrides) -> tuple[Path, Path]:
    """(AWQ/GPTQ dir, float reference dir) from a tiny random HF LLaMA. `act_order` maps the
    input kinds of PROJ to "random" or "local" (per tp-rank half)."""
    base = make_tiny_llama(tmp_path / "base", intermediate_size=128, **overrides)
    config = json.loads((base / "config.json").read_text())
    sd = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    quant, ref = dict(sd), dict(sd)
    for layer in range(config["num_hidden_layers"]):
        g_idx_of: dict[str, torch.Tensor] = {}
        for proj, kind in PROJ.items():
            name = f"model.layers.{layer}.{proj}"
            w = sd[f"{name}.weight"]
            k = w.shape[1]
            order = (act_order or {}).get(kind)
            if kind not in g_idx_of:
                g_idx_of[kind] = g_idx_for(k, group, order, gen, halves=2)
            g_idx = g_idx_of[kind]
            groups = int(g_idx.max()) + 1
            q, z, s = quantize_by_groups(w, g_idx, groups)
            ref[f"{name}.weight"] = ((q - z[g_idx]).float() * s[g_idx]).t().contiguous()  # [N, K]
            del quant[f"{name}.weight"]
            quant[f"{name}.scales"] = s
            if method == "awq":
                quant[f"{name}.qweight"], quant[f"{name}.qzeros"] = pack_awq(q), pack_awq(z)
            else:
                quant[f"{name}.qweight"] = pack_gptq_rows(q)
                quant[f"{name}.qzeros"] = pack_sequential_cols(z - 1 if v1 else z)
                quant[f"{name}.g_idx"] = g_idx.to(torch.int32)
    qdir, rdir = tmp_path / method, tmp_path / "reference"
    for d, tensors in ((qdir, quant), (rdir, ref)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
    (rdir / "config.json").write_text(json.dumps(config))
    qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": bool(act_order), "sym": False,
           "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    (qdir / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return qdir, rdir


def _logits(engine: Engine, prompt: list[int], steps: int = 3) -> torch.Tensor:
    runner = EngineRunner(engine, max_tokens=64)
    out = [runner.feed(prompt, all_logits=True)]  # a 12-token prefill: the dequantized dense path
    for _ in range(steps):  # one token: the aten int4 kernel
        out.append(runner.feed([int(out[-1][-1].argmax())]))
    return torch.cat(out)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


CASES = {
    "awq_g32": dict(method="awq", group=32),
    "gptq_v1_g32": dict(method="gptq", group=32),
    "gptq_v1_act_order": dict(method="gptq", group=32, act_order={"attn_in": "random", "mlp_in": "random",
                                                                  "o": "random", "down": "random"}),
    "gptq_v2_per_channel_tied": dict(method="gptq", group=-1, v1=False, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_imported_engine_equals_hand_dequantized_float_model(case, tmp_path):
    qdir, rdir = make_quantized(tmp_path, **CASES[case])
    convert(qdir, tmp_path / "q", show_progress=False)
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    method = CASES[case]["method"]
    assert section["quant_algo"] == {"awq": "W4A16_AWQ", "gptq": "W4A16_GPTQ"}[method]
    assert section["group_size"] == (128 if CASES[case]["group"] == -1 else 32)
    assert section["exclude_modules"] == ["lm_head"]  # the source's float lm_head (or tied embedding)
    engine = Engine.load(tmp_path / "q")
    set_compute_dtype(engine.model, torch.float32)
    assert len(quantized_linears(engine.model)) == 2 * 5  # qkv, dense, fc, gate, proj per layer
    ref = Engine.load(convert(rdir, tmp_path / "ref", show_progress=False))
    prompt = list(range(3, 15))
    ours, theirs = _logits(engine, prompt), _logits(ref, prompt)
    assert _close(ours, theirs) < 1e-4
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())


def _rewrite(qdir: Path, tensors=None, config=None) -> None:
    if tensors is not None:
        save_file(tensors, str(qdir / "model.safetensors"))
    if config is not None:
        (qdir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mistake", ["awq_sequential_nibbles", "gptq_v1_read_as_v2", "gptq_g_idx_dropped"])
def test_layout_mistakes_change_the_logits(mistake, tmp_path):
    """Broken variants: the comparison above can fail (each mistake moves the logits)."""
    case = {"awq_sequential_nibbles": CASES["awq_g32"], "gptq_v1_read_as_v2": CASES["gptq_v1_g32"],
            "gptq_g_idx_dropped": CASES["gptq_v1_act_order"]}[mistake]
    qdir, rdir = make_quantized(tmp_path, **case)
    tensors = load_file(str(qdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    if mistake == "awq_sequential_nibbles":
        for key in [k for k in tensors if k.endswith(".qweight")]:
            codes = hf_formats.unpack_awq(tensors[key])  # the true codes, re-packed in the wrong order
            tensors[key] = pack_sequential_cols(codes)
        _rewrite(qdir, tensors=tensors)
    elif mistake == "gptq_v1_read_as_v2":
        config["quantization_config"]["checkpoint_format"] = "gptq_v2"
        _rewrite(qdir, config=config)
    else:
        _rewrite(qdir, tensors={k: v for k, v in tensors.items() if not k.endswith(".g_idx")})
    engine = Engine.load(convert(qdir, tmp_path / "q", show_progress=False))
    set_compute_dtype(engine.model, torch.float32)
    ref = Engine.load(convert(rdir, tmp_path / "ref", show_progress=False))
    assert _close(_logits(engine, list(range(3, 15))), _logits(ref, list(range(3, 15)))) > 1e-3


# --- tensor parallel --------------------------------------------------------------------------
def test_tp2_convert_reassembles_to_tp1(tmp_path):
    act_order = {"attn_in": "random", "mlp_in": "random", "o": "local", "down": "local"}
    qdir, rdir = make_quantized(tmp_path, "gptq", 32, act_order=act_order)
    convert(qdir, tmp_path / "tp1", show_progress=False)
    convert(qdir, tmp_path / "tp2", ConvertOptions(tp_size=2), show_progress=False)
    whole = load_file(str(tmp_path / "tp1" / "rank0.safetensors"))
    joined = reassemble_checkpoint(tmp_path / "tp2")
    assert set(joined) == set(whole)
    for key, tensor in whole.items():
        assert torch.equal(joined[key], tensor), key
    # the two row-parallel halves of mlp.proj (local act-order) add up to the float matmul
    ref_w = load_file(str(rdir / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]  # [64, 128]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(3, 64)
    for rank in range(2):
        tensors = load_file(str(tmp_path / "tp2" / f"rank{rank}.safetensors"))
        lin = Linear(128, 64, parallel=Parallel.ROW, tp_rank=rank, tp_size=2)
        lin.name = "transformer.layers.1.mlp.proj"
        WeightOnlySlot.install(lin, LinearQuant("W4A16_GPTQ", 4, 32, True))
        for name in ("weight", "weights_scaling_factor", "zeros", "in_perm"):
            getattr(lin, name).data = tensors[f"transformer.layers.1.mlp.proj.{name}"]
        assert lin.quant.input_perm(lin, x.device) is not None  # a real permutation on this rank
        lin.fuse()
        lin.quant.set_compute_dtype(lin, torch.float32)
        y += lin.quant.matmul(lin, x[:, rank * 64:(rank + 1) * 64], None)
    assert (y - x @ ref_w.t()).abs().max() < 1e-4 * (x @ ref_w.t()).abs().max()


def test_tp2_refuses_act_order_across_ranks(tmp_path):
    qdir, _ = make_quantized(tmp_path, "gptq", 32, act_order={"down": "random"})
    with pytest.raises(BestiaryError, match=r"^--tp_size 2: transformer.layers.0.mlp.proj has act-order"):
        convert(qdir, tmp_path / "out", ConvertOptions(tp_size=2), show_progress=False)
    assert not (tmp_path / "out").exists()


def test_fused_qkv_with_different_act_orders_is_refused(tmp_path):
    qdir, _ = make_quantized(tmp_path, "gptq", 32, act_order={"attn_in": "random"})
    tensors = load_file(str(qdir / "model.safetensors"))
    key = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[key] = torch.arange(64, dtype=torch.int32) // 32  # k differs from q and v
    _rewrite(qdir, tensors=tensors)
    with pytest.raises(WeightsError, match="attention.qkv.in_perm: the fused source layers have different act-order"):
        convert(qdir, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


# --- malformed checkpoints ---------------------------------------------------------------------
def _break(qdir: Path, what: str) -> None:
    tensors = load_file(str(qdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    if what == "qweight_shape":
        key = "model.layers.0.self_attn.q_proj.qweight"
        tensors[key] = torch.cat([tensors[key], tensors[key][:, :1]], dim=1)  # [64, 9]
    elif what == "missing_scales":
        del tensors["model.layers.1.mlp.up_proj.scales"]
    elif what == "float_qweight":
        key = "model.layers.0.mlp.down_proj.qweight"
        tensors[key] = tensors[key].float()
    elif what == "bits_3":
        config["quantization_config"]["bits"] = 3
    elif what == "awq_gemv":
        config["quantization_config"]["version"] = "gemv"
    elif what == "group_48":
        config["quantization_config"]["group_size"] = 48
    _rewrite(qdir, tensors, config)


@pytest.mark.parametrize("what,error,message", [
    ("qweight_shape", WeightsError, r"model.layers.0.self_attn.q_proj.qweight has shape \[64, 9\], expected \[in, out/8\]"),
    ("missing_scales", WeightsError, r"model.layers.1.mlp.up_proj.scales is missing"),
    ("float_qweight", WeightsError, r"model.layers.0.mlp.down_proj.qweight is torch.float32, expected int32"),
    ("bits_3", ConfigError, r"quantization_config.bits 3: expected 4"),
    ("awq_gemv", ConfigError, r"quantization_config.version 'gemv': expected gemm"),
    ("group_48", ConfigError, r"quantization_config.group_size 48: expected -1 or a multiple of 32"),
])
def test_malformed_checkpoints_are_refused_in_one_line(what, error, message, tmp_path):
    qdir, _ = make_quantized(tmp_path, "awq", 32)
    _break(qdir, what)
    with pytest.raises(error, match=message) as info:
        convert(qdir, tmp_path / "out", show_progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_cli_imports_and_refuses(tmp_path):
    qdir, _ = make_quantized(tmp_path, "gptq", 32)
    base = [sys.executable, "-m", "bestiary.core.cli", "convert", "--model_dir", str(qdir)]
    ok = subprocess.run(base + ["--output_dir", str(tmp_path / "ok")], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16_GPTQ"
    bad = subprocess.run(base + ["--output_dir", str(tmp_path / "bad"), "--use_weight_only"], capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "already quantized (gptq)" in bad.stderr
    assert not (tmp_path / "bad").exists()
