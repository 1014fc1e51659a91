"""Weight-only quantization (W8A16, W4A16): packing, convert, load, CPU kernels, refusals.

Every quantized engine is compared with a plain reference: the stored int8/int4 tensors
dequantized by hand in this file (nibbles split with & 0xF / >> 4, (q - z) * s), written
as a float checkpoint and run through the float engine. Packing is exact, so with the
quantized matmuls in float32 the logits agree to float rounding.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bestiary.core.kernels import dispatch

pytest.importorskip("transformers")

from parity import EngineRunner
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format import packing
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.quant.apply import quantized_linears, set_compute_dtype, set_max_kernel_tokens
from bestiary.core.quant.modes import LinearQuant
from bestiary.core.quant.options import QuantFlags, quant_config_from_flags
from bestiary.core.quant.slot import WeightOnlySlot
from bestiary.core.runtime.engine import Engine

MODES = {
    "int8": QuantConfig(quant_algo="W8A16"),
    "int4_g32": QuantConfig(quant_algo="W4A16", group_size=32),
    "int4_g64_zp": QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True),
}


# --- golden layouts, written by hand -------------------------------------------------------
def test_int4_pack_golden_bytes():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0], [0, 15, 7, 8, 9, 10]], dtype=torch.uint8)
    packed = packing.pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x87, 0xA9]]
    assert torch.equal(packing.unpack_int4(packed), codes)


def test_int4_cpu_layout_matches_aten_and_inverts():
    """Our torch description of the aten CPU int4 layout == aten's converter, and unpack inverts it."""
    gen = torch.Generator().manual_seed(0)
    for n in (16, 80, 128, 192):  # full row blocks (64 on AVX-512 torch, else 32) and a remainder block
        codes = torch.randint(0, 16, (n, 96), generator=gen, dtype=torch.int32)
        aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        assert torch.equal(packing.pack_int4_cpu(codes), aten)
        assert torch.equal(packing.unpack_int4_cpu(aten), codes.to(torch.uint8))


def test_quantizers_reconstruct_within_half_a_step():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    q, s = packing.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((packing.dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 + 1e-6).all()
    for zero in (False, True):
        codes, s, z = packing.quantize_int4_groupwise(w, 64, zero)
        err = (packing.dequantize_int4(codes, s, z, 64) - w).abs()
        assert (err <= s.repeat_interleave(64, 1) / 2 + 1e-6).all()
        assert codes.max() <= 15


# --- one Linear ------------------------------------------------------------------------------
def _quant_linear(lq: LinearQuant, n: int = 96, k: int = 128, seed: int = 0,
                  scale_dtype: torch.dtype = torch.float32) -> tuple[Linear, torch.Tensor]:
    """A quantized Linear [n, k] with bias from a random float weight (returned too); scales (the
    layer's dtype in a checkpoint) in scale_dtype."""
    gen = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=True, parallel=Parallel.COLUMN)
    lin.name = "layer"
    w = torch.randn(n, k, generator=gen) / k**0.5
    slot = WeightOnlySlot.install(lin, lq)
    for name, t in slot.quantize(w, scale_dtype).items():
        getattr(lin, name).data = t
    lin.bias.data = torch.randn(n, generator=gen)
    return lin, w


@pytest.mark.parametrize("lq", [LinearQuant("W8A16", 8), LinearQuant("W4A16", 4, 64),
                                LinearQuant("W4A16", 4, 32, True), LinearQuant("W4A16", 4, 128, True)],
                         ids=["int8", "int4_g64", "int4_g32_zp", "int4_g128_zp"])
def test_linear_kernels_equal_dequantized_matmul(lq):
    lin, _ = _quant_linear(lq)
    ref_w = lin.quant.dequantize(lin)  # [N, K], checkpoint layout
    lin.fuse()  # repack for the CPU kernels
    lin.quant.set_compute_dtype(lin, torch.float32)
    assert torch.equal(lin.quant.dequantize(lin), ref_w)  # the CPU layout holds the same codes
    for tokens in (1, 3, 40):  # the aten kernel (<= 8 tokens) and the dequantized dense path
        x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))
        ref = x @ ref_w.t() + lin.bias
        out = lin(x)
        assert (out - ref).abs().max() < 1e-4, tokens
    lin.quant.set_compute_dtype(lin, torch.bfloat16)  # the default: bf16 activations
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5))
    assert (lin(x) - (x @ ref_w.t() + lin.bias)).abs().max() < 3e-2
    lin.weights_scaling_factor.data[0] *= 1.01  # broken variant: one wrong scale must show
    lin.fuse()
    lin.quant.set_compute_dtype(lin, torch.float32)
    assert (lin(x) - (x @ ref_w.t() + lin.bias)).abs().max() > 1e-4


def test_int4_short_last_group_pads_for_the_kernel():
    lin, w = _quant_linear(LinearQuant("W4A16", 4, 64, True), k=96)  # groups of 64 and 32
    assert lin.weights_scaling_factor.shape == (96, 2)
    ref_w = lin.quant.dequantize(lin)
    assert (ref_w - w).abs().max() < 0.2
    x = torch.randn(2, 96)
    lin.fuse()  # the compiled kernels read the checkpoint layout, a short group as it is
    assert lin.quant.k_pad == 0 and (lin(x) - x @ ref_w.t() - lin.bias).abs().max() < 1e-4
    with dispatch.kernels_mode("torch"):  # aten's CPU int4 kernel: padded to a whole group
        lin.quant.set_compute_dtype(lin, torch.float32)
        assert lin.quant.k_pad == 32 and torch.equal(lin.quant.dequantize(lin), ref_w)
        assert (lin(x) - x @ ref_w.t() - lin.bias).abs().max() < 1e-4


def test_int4_rows_not_multiple_of_16_fall_back_to_dequantized():
    lin, _ = _quant_linear(LinearQuant("W4A16", 4, 64), n=40)
    ref_w = lin.quant.dequantize(lin)
    lin.fuse()
    lin.quant.set_compute_dtype(lin, torch.float32)
    x = torch.randn(1, 128)
    assert lin.quant.layout in ("checkpoint", "dot", "quads")  # not the aten CPU layout (N % 16 != 0)
    assert (lin(x) - x @ ref_w.t() - lin.bias).abs().max() < 1e-4


def test_int4_layout_follows_the_kernel_build(monkeypatch):
    """On a build with its own int4 GEMV layout the weight is repacked in place into it: the dot layout on
    avx512bf16 (vdpbf16ps; a bfloat16 layer only: a float32 layer keeps the checkpoint layout), the quads on
    avx2 (any layer). Prepared again under a build without that GEMV (BESTIARY_CPU_ISA switched in-process,
    benchmarks/cpu_isa.py) it goes back to the checkpoint layout, codes unchanged, and both give the same outputs."""
    from bestiary.core.format import packing
    from bestiary.core.kernels.cpu import ops

    lin, _ = _quant_linear(LinearQuant("W4A16", 4, 64, True), n=40, k=128, scale_dtype=torch.bfloat16)
    checkpoint_bytes, codes = lin.weight.detach().clone(), lin.quant.codes(lin)
    lin.fuse()
    layout = lin.quant.layout
    if layout == "checkpoint":
        pytest.skip("this CPU's kernel build reads int4 weights in the checkpoint layout")
    fp32_layer, _ = _quant_linear(LinearQuant("W4A16", 4, 64, True), n=40, k=128)
    fp32_layer.fuse()  # float32 activations: on avx512bf16 the checkpoint layout's GEMV is the faster one for them
    expect = {"dot": ("checkpoint", ops.KIND_I4), "quads": ("quads", ops.KIND_I4Q)}[layout]
    assert (fp32_layer.quant.layout, fp32_layer.quant._packed.kind) == expect
    repack = packing.pack_int4_dot if layout == "dot" else packing.pack_int4_quads
    assert torch.equal(lin.weight, repack(checkpoint_bytes)) and torch.equal(lin.quant.codes(lin), codes)
    assert lin.quant._packed.kind == (ops.KIND_I4D if layout == "dot" else ops.KIND_I4Q)
    x = torch.randn(2, 128).bfloat16()
    y_fast = lin(x)
    monkeypatch.setattr(ops, "int4_layout", lambda k, bfloat16=True: "checkpoint")
    lin.quant.prepare(lin)
    assert lin.quant.layout == "checkpoint" and torch.equal(lin.weight, checkpoint_bytes)
    assert lin.quant._packed.kind == ops.KIND_I4
    torch.testing.assert_close(lin(x).float(), y_fast.float(), rtol=1e-2, atol=1e-2)  # bf16 outputs


def test_int8_weight_held_in_row_tiles_in_place():
    """With the compiled kernels an int8 weight (N % 8 == 0, K % 16 == 0) is repacked in place into
    row tiles (one copy); dequantize reads it back, the aten path (kernels off) and a move to
    another device get the checkpoint layout again, and all give the same output."""
    from bestiary.core.format import packing
    from bestiary.core.layers import cpu_matmul

    lin, _ = _quant_linear(LinearQuant("W8A16", 8), n=40, k=128)
    checkpoint_bytes, ref_w = lin.weight.detach().clone(), lin.quant.dequantize(lin)
    memory = lin.weight.data_ptr()
    with cpu_matmul.repack_in_place():  # as an engine load does (its own reads)
        lin.fuse()
    lin.quant.set_compute_dtype(lin, torch.float32)
    if not lin.quant.runs_compiled(lin):
        pytest.skip("no compiled CPU kernels here")
    assert lin.quant.layout == "tiled" and torch.equal(lin.weight, packing.pack_int8_tiled(checkpoint_bytes))
    assert lin.weight.data_ptr() == memory  # the codes' own memory, not a second tensor beside them
    assert torch.equal(lin.quant.dequantize(lin), ref_w)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    y_tiled = lin(x)
    assert (y_tiled - x @ ref_w.t() - lin.bias).abs().max() < 1e-4
    with dispatch.kernels_mode("torch"):
        lin.quant.prepare(lin)
        assert lin.quant.layout == "checkpoint" and torch.equal(lin.weight, checkpoint_bytes)
        assert (lin(x) - y_tiled).abs().max() < 1e-4
    lin.quant.prepare(lin)
    assert lin.quant.layout == "tiled"
    lin.to("meta")
    lin.quant.prepare(lin)
    assert lin.quant.layout == "checkpoint"


W4A8 = LinearQuant("W4A16", 4, 32, act_quant="int8")  # W4A8 dynamic: W4A16 weights, int8 activations


def test_w4a8_weight_held_in_quads_in_place():
    """With the compiled kernels a W4A8 int4 weight is repacked in place into quads (8 features of a tile's
    8 rows a load, the tile one stream; the short last tile of N % 8 rows too); codes and dequantize read it
    back, and the torch path and a move to another device get the checkpoint layout again."""
    from bestiary.core.format import packing
    from bestiary.core.layers import cpu_matmul

    lin, _ = _quant_linear(W4A8, n=44, k=96)
    checkpoint_bytes, codes, ref_w = lin.weight.detach().clone(), lin.quant.codes(lin), lin.quant.dequantize(lin)
    memory = lin.weight.data_ptr()
    with cpu_matmul.repack_in_place():  # as an engine load does (its own reads)
        lin.fuse()
    if not lin.quant.runs_compiled(lin):
        pytest.skip("no compiled CPU kernels here")
    assert lin.quant.layout == "quads" and lin.weight.data_ptr() == memory
    quads = lin.weight.view(-1)
    # tile 0, quad 1 (features 8..15): rows 0..7's bytes 4..7 one after another; tile 5 (rows 40..43): 4 rows
    assert torch.equal(quads[32:64].view(8, 4), checkpoint_bytes[:8, 4:8])
    assert torch.equal(quads[40 * 48 + 16:40 * 48 + 32].view(4, 4), checkpoint_bytes[40:, 4:8])
    assert torch.equal(lin.quant.codes(lin), codes) and torch.equal(lin.quant.dequantize(lin), ref_w)
    assert torch.equal(packing.unpack_int4_quads(lin.weight), checkpoint_bytes)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    y = lin(x)
    with dispatch.kernels_mode("torch"):
        lin.quant.prepare(lin)
        assert lin.quant.layout == "checkpoint" and torch.equal(lin.weight, checkpoint_bytes)
    lin.quant.prepare(lin)
    assert lin.quant.layout == "quads" and torch.equal(lin(x), y)
    lin.to("meta")
    lin.quant.prepare(lin)
    assert lin.quant.layout == "checkpoint"


@pytest.mark.parametrize("lq,layout,tol", [(LinearQuant("W8A16", 8), "tiled", 1e-4), (W4A8, "quads", 5e-2)],
                         ids=["int8", "w4a8"])
def test_tiled_layouts_fuse_only_whole_tiles(lq, layout, tol):
    """Fused members are views of the fused layer's rows: with the int8 row tiles or the W4A8 quads, only
    members of whole 8-row tiles fuse, else each member keeps its own weight; preparing the layer again keeps
    its tiles (W4A8 once repacked them anew, and the members' views held the old ones: +31% resident at 1.1B)."""
    from bestiary.core.quant.fuse import fuse_quantized

    def members(*rows: int) -> list[Linear]:
        out = [_quant_linear(lq, n=n, k=64, seed=n)[0] for n in rows]
        for m in out:
            m.bias = None
        return out

    parts = members(16, 24)
    weights = [m.quant.dequantize(m) for m in parts]
    fused = fuse_quantized(parts)
    if not fused.quant.runs_compiled(fused):
        pytest.skip("no compiled CPU kernels here")
    fused.quant.set_compute_dtype(fused, torch.float32)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    assert fused.quant.layout == layout and (fused(x) - x @ torch.cat(weights).t()).abs().max() < tol  # (W4A8: x in int8)
    assert all(m.quant.layout == layout and torch.equal(m.quant.dequantize(m), w) for m, w in zip(parts, weights))
    memory = fused.weight.untyped_storage().data_ptr()
    fused.quant.prepare(fused)  # prepared again (a load does): the same tiles, the members' views still on them
    assert fused.weight.untyped_storage().data_ptr() == memory
    assert all(m.weight.untyped_storage().data_ptr() == memory for m in parts)
    assert fuse_quantized(members(12, 20)) is None


def test_int4_dot_layout_refused_by_other_builds(monkeypatch):
    """A weight packed for the avx512bf16 build is never handed to another one."""
    from bestiary.core.kernels.cpu import ops

    class OtherBuild:
        def bst_isa(self) -> int:
            return 2

    pw = ops.PackedWeight(ops.KIND_I4D, torch.zeros(4, 32, dtype=torch.uint8), 4, 64, torch.ones(4, 1),
                          torch.zeros(4, 1), 64)
    monkeypatch.setattr(ops, "library", lambda: OtherBuild())
    with pytest.raises(ValueError, match="avx512bf16"):
        ops.linear(torch.zeros(1, 64), pw)


# --- checkpoints ---------------------------------------------------------------------------
def dequantize_by_hand(tensors: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    """The float weight [N, K] of `prefix` from the stored tensors, written out from the layout doc."""
    w = tensors[f"{prefix}.weight"]
    s = tensors[f"{prefix}.weights_scaling_factor"].float()
    if w.dtype == torch.int8:
        return w.float() * s[:, None]
    q = torch.empty(w.shape[0], w.shape[1] * 2)
    q[:, 0::2], q[:, 1::2] = (w & 0xF).float(), (w >> 4).float()
    k = q.shape[1]
    assert s.shape[1] == -(-k // group)  # a short last group when group does not divide K
    z = tensors[f"{prefix}.zeros"].float().repeat_interleave(group, 1)[:, :k] if f"{prefix}.zeros" in tensors else 8.0
    return (q - z) * s.repeat_interleave(group, 1)[:, :k]


def float_reference(ckpt: Path, out: Path) -> Path:
    """A float checkpoint holding the hand-dequantized weights of quantized checkpoint `ckpt`."""
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    plain = {}
    for key, t in tensors.items():
        prefix, _, name = key.rpartition(".")
        if name in ("weights_scaling_factor", "zeros"):
            continue
        quantized = name == "weight" and f"{prefix}.weights_scaling_factor" in tensors  # not its bias
        plain[key] = dequantize_by_hand(tensors, prefix, config["quantization"]["group_size"]) if quantized else t
    if "lm_head.weight" in plain and "tie_word_embeddings" in config:
        config["tie_word_embeddings"] = False  # the quantized copy of a tied lm_head
    config["quantization"] = QuantConfig().model_dump(mode="json")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(plain, str(out / "rank0.safetensors"))
    return out


def _logits(engine: Engine, prompt: list[int], steps: int = 3) -> torch.Tensor:
    runner = EngineRunner(engine, max_tokens=64)
    out = [runner.feed(prompt, all_logits=True)]  # 12 tokens: the dequantized dense path
    for _ in range(steps):  # one token: the aten kernels
        out.append(runner.feed([int(out[-1][-1].argmax())]))
    return torch.cat(out)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("quant"), intermediate_size=128)


@pytest.mark.parametrize("mode", list(MODES) + ["int4_g64_ragged"])
def test_engine_logits_equal_hand_dequantized_reference(mode, tiny_src, tmp_path):
    if mode == "int4_g64_ragged":  # intermediate 80: mlp.proj's last group has 16 features
        tiny_src = make_tiny_llama(tmp_path)
    quant = MODES.get(mode, QuantConfig(quant_algo="W4A16", group_size=64))
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=quant), show_progress=False)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == quant.quant_algo
    engine = Engine.load(tmp_path / "q")
    set_compute_dtype(engine.model, torch.float32)
    assert len(quantized_linears(engine.model)) == 2 * 5 + 1  # qkv, dense, fc, gate, proj per layer; lm_head
    ref = Engine.load(float_reference(tmp_path / "q", tmp_path / "ref"))
    prompt = list(range(3, 15))
    ours, theirs = _logits(engine, prompt), _logits(ref, prompt)
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())
    float_engine = Engine.load(convert(tiny_src, tmp_path / "f", show_progress=False))
    assert (_logits(float_engine, prompt) - theirs).abs().max() > 1e-3  # the reference is really quantized


def test_bf16_activations_stay_close(tiny_src, tmp_path):
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=MODES["int8"]), show_progress=False)
    engine = Engine.load(tmp_path / "q")
    ref = Engine.load(float_reference(tmp_path / "q", tmp_path / "ref"))
    ours, theirs = _logits(engine, list(range(3, 15))), _logits(ref, list(range(3, 15)))
    assert (ours - theirs).abs().max() < 5e-2 * theirs.abs().max()


def test_excluded_modules_stay_float(tiny_src, tmp_path):
    quant = QuantConfig(quant_algo="W8A16", exclude_modules=["lm_head", "mlp.proj"])
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=quant), show_progress=False)
    tensors = load_file(str(tmp_path / "q" / "rank0.safetensors"))
    assert tensors["lm_head.weight"].dtype == torch.float32 and "lm_head.weights_scaling_factor" not in tensors
    assert tensors["transformer.layers.1.mlp.proj.weight"].dtype == torch.float32
    assert tensors["transformer.layers.1.mlp.fc.weight"].dtype == torch.int8


def test_tied_lm_head_gets_a_quantized_copy(tmp_path):
    src = make_tiny_llama(tmp_path, intermediate_size=128, tie_word_embeddings=True)
    convert(src, tmp_path / "q", ConvertOptions(quantization=MODES["int4_g32"]), show_progress=False)
    tensors = load_file(str(tmp_path / "q" / "rank0.safetensors"))
    assert tensors["transformer.vocab_embedding.weight"].dtype == torch.float32  # the lookup stays float
    assert tensors["lm_head.weight"].dtype == torch.uint8
    engine = Engine.load(tmp_path / "q")
    set_compute_dtype(engine.model, torch.float32)
    ref = Engine.load(float_reference(tmp_path / "q", tmp_path / "ref"))
    ours, theirs = _logits(engine, [5, 6, 7]), _logits(ref, [5, 6, 7])
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())
    # excluded: shared again, no lm_head tensor at all
    convert(src, tmp_path / "x",
            ConvertOptions(quantization=QuantConfig(quant_algo="W4A16", group_size=32, exclude_modules=["lm_head"])),
            show_progress=False)
    assert "lm_head.weight" not in load_file(str(tmp_path / "x" / "rank0.safetensors"))


def test_kernel_threshold_does_not_change_results(tiny_src, tmp_path):
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=MODES["int4_g64_zp"]), show_progress=False)
    engine = Engine.load(tmp_path / "q")
    set_compute_dtype(engine.model, torch.float32)
    set_max_kernel_tokens(engine.model, 0)  # the 12-token prefill dequantizes
    a = _logits(engine, list(range(3, 15)))
    set_max_kernel_tokens(engine.model, 64)  # the prefill now runs the weight-only kernel too
    b = _logits(engine, list(range(3, 15)))
    assert (a - b).abs().max() < 1e-4 * a.abs().max()


@pytest.mark.parametrize("mode,bits", [("int8", 8), ("int4_g64_zp", 4)])
def test_kernel_bound_follows_the_kernel_build(mode, bits, tiny_src, tmp_path, monkeypatch):
    """A layer on the compiled kernels runs its GEMV up to COMPILED_MAX_TOKENS[build][bits] rows (int4 quads of a
    float32 layer, whose inputs take the quads' float path: at most QUADS_FLOAT_MAX_TOKENS); with AMX (torch's
    bf16 GEMM) or without the compiled kernels, DEFAULT_MAX_KERNEL_TOKENS; set_max_kernel_tokens overrides either."""
    from bestiary.core.kernels.cpu.build import isa_name, library
    from bestiary.core.quant import slot as slot_module

    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=MODES[mode]), show_progress=False)
    engine = Engine.load(tmp_path / "q")
    linears = list(quantized_linears(engine.model).values())
    compiled = [m.quant._packed is not None for m in linears]
    default = slot_module.DEFAULT_MAX_KERNEL_TOKENS
    table = slot_module.COMPILED_MAX_TOKENS.get(isa_name(library()), {}).get(bits, default) if any(compiled) else default
    float_quads = [m.quant.layout == "quads" and m.weights_scaling_factor.dtype != torch.bfloat16 for m in linears]
    expect = [min(table, slot_module.QUADS_FLOAT_MAX_TOKENS) if q else table for q in float_quads]
    assert [m.quant.kernel_max_tokens() for m in linears] == [e if c else default for e, c in zip(expect, compiled)]
    monkeypatch.setattr(slot_module, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    for m in linears:
        m.quant.prepare(m)
    assert {m.quant.kernel_max_tokens() for m in linears} == {default}
    set_max_kernel_tokens(engine.model, 5)
    assert {m.quant.kernel_max_tokens() for m in linears} == {5}


# --- refusals --------------------------------------------------------------------------------
def test_groups_straddling_tensor_parallel_ranks_are_refused_before_writing(tmp_path):
    src = make_tiny_llama(tmp_path)  # intermediate 80: mlp.proj (row-parallel) has 40 input features per rank
    quant = QuantConfig(quant_algo="W4A16", group_size=32)
    with pytest.raises(ConfigError, match=r"--group_size 32: transformer.layers.0.mlp.proj has 40 input features per"):
        convert(src, tmp_path / "q", ConvertOptions(tp_size=2, quantization=quant), show_progress=False)
    assert not (tmp_path / "q").exists()
    # excluding that layer makes it possible; one rank has no straddling groups
    convert(src, tmp_path / "q", ConvertOptions(tp_size=2, weight_quantizer="rtn", quantization=QuantConfig(
        quant_algo="W4A16", group_size=32, exclude_modules=["mlp.proj"])), show_progress=False)
    convert(src, tmp_path / "q1", ConvertOptions(quantization=quant), show_progress=False)


@pytest.mark.parametrize("flags,message", [
    (QuantFlags(use_weight_only=True, weight_only_precision="int8", group_size=64), "--group_size: only for"),
    (QuantFlags(use_weight_only=True, weight_only_precision="int4", group_size=48), "--group_size 48: expected"),
    (QuantFlags(weight_only_precision="int4"), "--weight_only_precision: needs"),
    (QuantFlags(int8_kv_cache=True, fp8_kv_cache=True), "pick one"),
])
def test_bad_flag_combinations(flags, message):
    with pytest.raises(ConfigError, match=message):
        quant_config_from_flags(flags)


def test_flags_to_config():
    q = quant_config_from_flags(QuantFlags(use_weight_only=True, weight_only_precision="int4", has_zero_point=True,
                                           exclude_modules=["lm_head"]))
    assert (q.quant_algo, q.group_size, q.has_zero_point, q.exclude_modules) == ("W4A16", 128, True, ["lm_head"])
    assert quant_config_from_flags(QuantFlags(use_weight_only=True)).quant_algo == "W8A16"


def test_cli_convert_int4_and_refusal(tmp_path):
    src = make_tiny_llama(tmp_path)
    base = [sys.executable, "-m", "bestiary.core.cli", "convert", "--model_dir", str(src)]
    bad = subprocess.run(base + ["--output_dir", str(tmp_path / "bad"), "--use_weight_only", "--tp_size", "2",
                                 "--weight_only_precision", "int4", "--group_size", "32"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "40 input features per" in bad.stderr
    assert not (tmp_path / "bad").exists()
    ok = subprocess.run(base + ["--output_dir", str(tmp_path / "ok"), "--use_weight_only", "--weight_only_precision",
                                "int4", "--group_size", "32", "--has_zero_point", "--exclude_modules", "lm_head", "*.layers.1.*"],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    section = json.loads((tmp_path / "ok" / "config.json").read_text())["quantization"]
    assert section == {"quant_algo": "W4A16", "kv_cache_quant_algo": None, "group_size": 32, "has_zero_point": True,
                       "pre_quant_scale": False, "activation_quant": None, "activation_group_size": None,
                       "exclude_modules": ["lm_head", "*.layers.1.*"]}
    shutil.rmtree(tmp_path / "ok")


def test_packing_grids_equal_hand_computed_values():
    """The int8 / int4 grids of core.format.packing on values worked out by hand (mutation testing:
    a ratio applied as a division, a min/max over all groups instead of each, a range that leaves
    out 0, a zero point clamped from 1, a row-parallel amax ignored, (q - z) / s all survived the
    round trips of this file)."""
    g = torch.tensor([[[0.2, 0.5, 0.1, 0.3], [-3.0, 1.5, 0.0, 0.0]], [[-0.6, -0.3, -0.9, -0.1], [0.0, 0.0, 0.0, 0.0]]])
    s, z = packing.int4_grid(g, zero_point=True)  # range [min(lo, 0), max(hi, 0)] / 15, z = round(-lo / s)
    torch.testing.assert_close(s, torch.tensor([[0.5 / 15, 4.5 / 15], [0.9 / 15, 1e-12]]))
    torch.testing.assert_close(z, torch.tensor([[0.0, 10.0], [15.0, 0.0]]))
    s, z = packing.int4_grid(g, zero_point=True, ratio=0.5)  # the range shrunk by the ratio
    torch.testing.assert_close(s, torch.tensor([[0.25 / 15, 2.25 / 15], [0.45 / 15, 1e-12]]))
    torch.testing.assert_close(z, torch.tensor([[0.0, 10.0], [15.0, 0.0]]))
    s, z = packing.int4_grid(g, zero_point=False, ratio=0.5)  # symmetric: max |w| r / 7
    assert z is None
    torch.testing.assert_close(s, torch.tensor([[0.25 / 7, 1.5 / 7], [0.45 / 7, 1e-12]]))

    w = torch.tensor([[0.0, 0.5, -1.0, 1.0], [2.0, -2.0, 0.5, 0.0]])
    q, s = packing.quantize_int8_per_channel(w, amax=torch.tensor([2.0, 4.0]))  # a row-parallel part: whole rows' amax
    torch.testing.assert_close(s, torch.tensor([2.0, 4.0]) / 127)
    assert q.tolist() == [[0, 32, -64, 64], [64, -64, 16, 0]]  # round(w / s): 0.5 / (2 / 127) = 31.75 -> 32
    torch.testing.assert_close(packing.dequantize_int8(q, s, torch.tensor([1, -2])),
                               (q.float() - torch.tensor([[1.0], [-2.0]])) * s[:, None])
    torch.testing.assert_close(packing.dequantize_int8(torch.tensor([[10, -3]], dtype=torch.int8), torch.tensor([0.5]),
                                                       torch.tensor([2])), torch.tensor([[4.0, -2.5]]))


@pytest.mark.parametrize("zero_point", [False, True])
def test_int4_roundtrip_is_quantize_then_dequantize_bit_for_bit(zero_point):
    """The AWQ / GPTQ searches' float roundtrip (no codes) equals the codes' dequantization exactly: more rows
    than one block of packing.QUANT_ROWS, a short last group, ties at .5 steps, outliers that clamp."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(packing.QUANT_ROWS + 5, 80, generator=gen)  # 80 = 2 groups of 32 + 16
    w[::7, ::5] *= 40  # outliers: the other weights of their groups clamp or round coarsely
    w[1, :32] = torch.arange(32) * 0.5 - 8  # steps of half the scale: round-half-to-even ties
    codes, s, z = packing.quantize_int4_groupwise(w, 32, zero_point)
    assert torch.equal(packing.int4_roundtrip(w, 32, zero_point), packing.dequantize_int4(codes, s, z, 32))


def test_packing_layouts_and_round_trips_by_hand():
    """More packing survivors: a small row amax (s floor), int4 round trips with zero points, the
    aten CPU int4 layout with a remainder block and its shape check, the symmetric scale table."""
    q, s = packing.quantize_int8_per_channel(torch.tensor([[0.5, -0.25]]))  # amax 0.5 < 1: s = 0.5 / 127
    torch.testing.assert_close(s, torch.tensor([0.5 / 127]))
    assert q.tolist() == [[127, -64]]  # -63.5 rounds to even

    w = torch.tensor([[0.9, 0.1, -0.2, 0.4], [1.5, 0.0, 0.3, 0.6]])
    codes, s, z = packing.quantize_int4_groupwise(w, 4, zero_point=True)
    expected = (codes.float() - z) * s  # one group per row
    torch.testing.assert_close(packing.int4_roundtrip(w, 4, True), expected)
    assert not torch.equal(expected, codes.float() * s)  # the zero point matters here

    codes = torch.randint(0, 16, (80, 6), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = packing.pack_int4_cpu(codes)  # full row blocks (64 or 32) + a 16-row remainder block
    assert torch.equal(packing.unpack_int4_cpu(packed), codes)
    tail = packed.reshape(-1)[64 * 6 // 2:].view(6, -1)  # remainder, k-major: byte j = rows 2j | 2j + 1
    assert tail[0, 0].item() == int(codes[64, 0]) | (int(codes[65, 0]) << 4)
    for shape in ((16, 3), (8, 4)):
        with pytest.raises(ValueError, match="out_features % 16 == 0 and even in_features"):
            packing.pack_int4_cpu(torch.zeros(shape, dtype=torch.uint8))

    s = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)  # [N 1, groups 2]
    table = packing.int4_cpu_scale_zeros(s, None, torch.bfloat16)  # symmetric: offset 0
    assert table.dtype == torch.bfloat16 and table.shape == (2, 1, 2)
    assert table[:, 0].tolist() == [[0.5, 0.0], [0.25, 0.0]]
    table = packing.int4_cpu_scale_zeros(s.float(), torch.tensor([[10.0, 8.0]]), torch.float32)
    assert table[:, 0].tolist() == [[0.5, -1.0], [0.25, 0.0]]  # offset (8 - z) s
