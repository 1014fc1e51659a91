"""The q/k/v fan-out under tensor parallelism: k and v are cut by whole kv heads.

With fewer kv heads than ranks (MQA, GQA with KVH < tp) each rank holds the one kv head its
query heads use, replicated on tp / KVH ranks; a contiguous 1/tp slice of k_proj would split
a head. Every sharded checkpoint must re-assemble to the tp 1 tensors (replicated copies equal),
and a source of the wrong shape is named in the error.
"""

from __future__ import annotations

import parity
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.errors import BestiaryError


def assert_reassembles(src, tmp_path, tp: int) -> dict[int, dict[str, torch.Tensor]]:
    """Convert at tp 1 and at `tp`; every whole tensor re-assembled from the ranks equals tp 1's."""
    convert(src, tmp_path / "tp1", show_progress=False)
    convert(src, tmp_path / f"tp{tp}", ConvertOptions(tp_size=tp), show_progress=False)
    whole = parity.reassemble_checkpoint(tmp_path / f"tp{tp}")
    reference = load_rank_weights(tmp_path / "tp1", 0)
    for key, tensor in reference.items():
        assert torch.equal(whole[key], tensor), key
    return {r: load_rank_weights(tmp_path / f"tp{tp}", r) for r in range(tp)}


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 1, 2), (4, 2, 4), (4, 1, 4), (4, 4, 2)])
def test_llama_qkv_fanout_replicates_whole_kv_heads(tmp_path, heads, kv_heads, tp):
    src = make_tiny_llama(tmp_path, num_attention_heads=heads, num_key_value_heads=kv_heads)
    ranks = assert_reassembles(src, tmp_path, tp)
    d = 64 // heads
    hf = load_file(str(src / "model.safetensors"))
    for r, weights in ranks.items():
        qkv = weights["transformer.layers.0.attention.qkv.weight"]
        q_rows, kv_rows = heads // tp * d, max(kv_heads // tp, 1) * d
        assert qkv.shape == (q_rows + 2 * kv_rows, 64)
        head = r * kv_heads // tp  # the rank's first kv head
        k = hf["model.layers.0.self_attn.k_proj.weight"][head * d : head * d + kv_rows]
        assert torch.equal(qkv[q_rows : q_rows + kv_rows], k), f"rank {r}"


def test_mixtral_kv1_tp2_replicates_kv_head(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    model = parity.reinit_(transformers.MixtralForCausalLM(cfg))
    src = parity.save_hf(model, tmp_path)
    ranks = assert_reassembles(src, tmp_path, 2)
    k0, k1 = (ranks[r]["transformer.layers.0.attention.qkv.weight"][16:24] for r in (0, 1))
    assert torch.equal(k0, k1)  # the one kv head on both ranks


def test_wrong_kv_source_is_named(tmp_path):
    """A k_proj with a row too few: the error names k_proj, not q_proj, and nothing is written."""
    src = make_tiny_llama(tmp_path, num_key_value_heads=1)
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = weights["model.layers.0.self_attn.k_proj.weight"][:8]
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BestiaryError) as err:
        convert(src, tmp_path / "out", ConvertOptions(tp_size=2), show_progress=False)
    message = str(err.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in message and "q_proj" not in message, message
    assert "expected 16 along dim 0" in message, message
    assert not (tmp_path / "out").exists()
