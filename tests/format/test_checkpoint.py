"""Checkpoint I/O: streamed rank files, atomic directories, TP/PP sharding, every source format."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format.checkpoint import StreamingSafetensorsWriter, atomic_directory  # noqa: E402
from bestiary.core.format.config import read_json  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402


def test_streaming_writer_any_order_roundtrip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(2, 2).bfloat16()}
    layout = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", layout)
    for key in ("c", "a", "b"):
        writer.write(key, tensors[key])
    writer.close()
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_streaming_writer_refuses_wrong_shape_and_missing(tmp_path):
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (1,))])
    with pytest.raises(BestiaryError, match="'a' is \\(3,\\)"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(BestiaryError, match="'b' was never written"):
        writer.close()


def test_atomic_directory_leaves_nothing_on_error(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_replaces_an_earlier_output_of_its_kind(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"architecture": "LlamaForCausalLM", "mapping": {}}')
    (out / "rank0.safetensors").write_text("x")
    with atomic_directory(out, "checkpoint") as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_directory_refuses_a_foreign_directory(tmp_path):
    """It used to replace it: a file and a subfolder of the user's were deleted."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BestiaryError, match="not empty and not a bestiary checkpoint"):
        with atomic_directory(out, "checkpoint") as tmp:
            (tmp / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _qkv_parts(t: torch.Tensor, heads: int, kv_heads: int, tp: int) -> list[torch.Tensor]:
    """Split one rank's fused qkv [(H + 2 KVH) / tp * D, ...] into its q, k, v rows."""
    d = t.shape[0] // ((heads + 2 * kv_heads) // tp)
    q, k = heads // tp * d, kv_heads // tp * d
    return [t[:q], t[q : q + k], t[q + k :]]


def reassemble(shards: list[dict], key: str, dim: int, heads: int, kv_heads: int) -> torch.Tensor:
    """Concatenate the tp shards of `key` back; fused qkv is re-assembled part by part."""
    tp = len(shards)
    if ".qkv." in key:
        parts = [_qkv_parts(s[key], heads, kv_heads, tp) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts], dim=0) for i in range(3)], dim=0)
    if dim < 0:
        assert all(torch.equal(s[key], shards[0][key]) for s in shards), key
        return shards[0][key]
    return torch.cat([s[key] for s in shards], dim=dim)


TP_DIMS = {"qkv.weight": 0, "dense.weight": 1, "fc.weight": 0, "gate.weight": 0, "proj.weight": 1, "lm_head.weight": 0}


def tp_dim(key: str) -> int:
    return next((d for suffix, d in TP_DIMS.items() if key.endswith(suffix)), -1)


def assert_tp_reassembles(src, tmp_path, tp: int, heads: int, kv_heads: int, **kw) -> None:
    convert(src, tmp_path / "tp1", ConvertOptions(**kw), show_progress=False)
    convert(src, tmp_path / f"tp{tp}", ConvertOptions(tp_size=tp, **kw), show_progress=False)
    full = load_file(str(tmp_path / "tp1" / "rank0.safetensors"))
    shards = [load_file(str(tmp_path / f"tp{tp}" / f"rank{r}.safetensors")) for r in range(tp)]
    config = read_json(tmp_path / f"tp{tp}" / "config.json")
    assert config["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1, "moe_tp_size": tp, "moe_ep_size": 1}
    keys = set(shards[0])
    assert keys - {"lm_head.weight"} == set(full) - {"lm_head.weight"}
    for key in keys:
        whole = full.get(key, full.get("transformer.vocab_embedding.weight") if key == "lm_head.weight" else None)
        assert torch.equal(reassemble(shards, key, tp_dim(key), heads, kv_heads), whole), key


def test_tiny_llama_tp2_reassembles(tmp_path):
    assert_tp_reassembles(make_tiny_llama(tmp_path), tmp_path, 2, heads=4, kv_heads=2)


def test_tiny_llama_tied_tp2_materialises_lm_head(tmp_path):
    assert_tp_reassembles(make_tiny_llama(tmp_path, tie_word_embeddings=True), tmp_path, 2, heads=4, kv_heads=2)


def test_pp2_splits_layers(tmp_path):
    src = make_tiny_llama(tmp_path, num_hidden_layers=3)
    convert(src, tmp_path / "pp1", show_progress=False)
    convert(src, tmp_path / "pp2", ConvertOptions(pp_size=2), show_progress=False)
    full = load_file(str(tmp_path / "pp1" / "rank0.safetensors"))
    first, last = (load_file(str(tmp_path / "pp2" / f"rank{r}.safetensors")) for r in range(2))
    assert "transformer.vocab_embedding.weight" in first and "lm_head.weight" not in first
    assert "transformer.ln_f.weight" in last and "transformer.vocab_embedding.weight" not in last
    # stage 0 holds global layers 0-1, stage 1 layer 2 (local index 0)
    assert torch.equal(first["transformer.layers.1.mlp.fc.weight"], full["transformer.layers.1.mlp.fc.weight"])
    assert torch.equal(last["transformer.layers.0.mlp.fc.weight"], full["transformer.layers.2.mlp.fc.weight"])


def test_tp_that_does_not_divide_heads_is_refused(tmp_path):
    src = make_tiny_llama(tmp_path)
    with pytest.raises(BestiaryError, match="--tp_size 3 .*must divide num_attention_heads 4"):
        convert(src, tmp_path / "out", ConvertOptions(tp_size=3), show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["bin", "pth"])
def test_torch_formats_equal_safetensors(tmp_path, fmt):
    src = make_tiny_llama(tmp_path)
    state = load_file(str(src / "model.safetensors"))
    torch_dir = tmp_path / fmt
    torch_dir.mkdir()
    (torch_dir / "config.json").write_text((src / "config.json").read_text())
    torch.save(state, torch_dir / f"pytorch_model.{fmt}")
    convert(src, tmp_path / "a", show_progress=False)
    convert(torch_dir / f"pytorch_model.{fmt}", tmp_path / "b", show_progress=False)
    a, b = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_single_safetensors_file_and_customized_key_dict(tmp_path):
    """A renamed source (LLaVA-style prefix) converts with customized_key_dict."""
    from safetensors.torch import save_file

    src = make_tiny_llama(tmp_path)
    state = {k.replace("model.", "language_model.model.", 1).replace("lm_head", "language_model.lm_head"): v
             for k, v in load_file(str(src / "model.safetensors")).items()}
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text((src / "config.json").read_text())
    save_file(state, str(other / "weights.safetensors"))
    with pytest.raises(BestiaryError, match="not found in the source"):
        convert(other / "weights.safetensors", tmp_path / "x", show_progress=False)
    options = ConvertOptions(customized_key_dict={"transformer": "language_model.model",
                                                  "lm_head": "language_model.lm_head"})
    convert(other / "weights.safetensors", tmp_path / "x", options, show_progress=False)
    convert(src, tmp_path / "ref", show_progress=False)
    a, b = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("x", "ref"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_smollm2_tp3_reassembles(tmp_path, smollm2_gguf):
    gguf = smollm2_gguf
    assert_tp_reassembles(gguf, tmp_path, 3, heads=9, kv_heads=3)
    with pytest.raises(BestiaryError, match="--tp_size 2 .*must divide num_attention_heads 9"):
        convert(gguf, tmp_path / "tp2", ConvertOptions(tp_size=2), show_progress=False)


def test_transposed_source_slices_along_the_other_dim(tmp_path):
    """A Conv1D-style (in, out) source through the `transpose` hook converts at tp 2 into the
    same shards as the (out, in) source: the loader slices it along the other dim."""
    import dataclasses

    from safetensors.torch import save_file

    from bestiary.registry import Registry

    src = make_tiny_llama(tmp_path)
    state = load_file(str(src / "model.safetensors"))
    flipped_dir = tmp_path / "conv1d"
    flipped_dir.mkdir()
    (flipped_dir / "config.json").write_text((src / "config.json").read_text())
    flipped = ("mlp.gate_proj.weight", "self_attn.o_proj.weight")  # column- and row-parallel targets
    save_file({k: v.t().contiguous() if k.endswith(flipped) else v for k, v in state.items()},
              str(flipped_dir / "model.safetensors"))
    registry = Registry.from_plugins()
    spec = registry.get("LlamaForCausalLM")
    hook = "bestiary.core.convert.postprocess:transpose"
    registry.specs[spec.name] = dataclasses.replace(
        spec, postprocess={**spec.postprocess, "*.mlp.fc.weight": hook, "*.attention.dense.weight": hook})
    convert(src, tmp_path / "ref", ConvertOptions(tp_size=2), show_progress=False)
    convert(flipped_dir, tmp_path / "flip", ConvertOptions(tp_size=2), registry=registry, show_progress=False)
    for rank in range(2):
        a, b = (load_file(str(tmp_path / d / f"rank{rank}.safetensors")) for d in ("ref", "flip"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank


def test_loaded_tensors_are_64_byte_aligned(tmp_path):
    """safetensors maps tensors at 8-byte-aligned file offsets; kernels fed loaded tensors as-is
    (int8 weights, bf16 scales -> aten._weight_int8pack_mm) segfaulted on such addresses."""
    from safetensors.torch import save_file

    from bestiary.core.format.checkpoint import load_rank_weights, rank_file

    tensors = {f"t{i}": torch.arange(n, dtype=dtype) for i, (n, dtype) in
               enumerate([(3, torch.int8), (5, torch.bfloat16), (7, torch.float32), (9, torch.int8), (64, torch.int8)])}
    save_file(tensors, str(rank_file(tmp_path, 0)))
    loaded = load_rank_weights(tmp_path, 0)
    assert all(t.data_ptr() % 64 == 0 for t in loaded.values())
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
