"""The CUDA graph decode step (core.runtime.cuda_graph) reads its static buffers, not the step's
metadata: every architecture a graph may capture gives the same decode logits through those buffers
(Triton kernels, the interpreter here; a table as wide as the pool, kv_lens in int32, the rotary table
reserved for the whole pool) as through the step's own metadata. The capture itself needs a GPU
(benchmarks/gpu_check.py); what it records is exactly this eager call on the buffers."""

from __future__ import annotations

import pytest
import torch
from test_kernels_end_to_end import BLOCK_SIZE, E2E_TOL, PROMPTS, TABLES, _cases, tiny_model

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.runtime import cuda_graph
from bestiary.core.runtime.kv_cache import KVCache


def _decode_pair(model, kv) -> tuple[torch.Tensor, AttentionMetadata]:
    """Prefill both PROMPTS, then the ids and metadata of one batched decode step."""
    model(torch.tensor([t for p in PROMPTS for t in p]),
          AttentionMetadata.build([len(p) for p in PROMPTS], [0, 0], TABLES, BLOCK_SIZE), kv, all_logits=True)
    ctx = [len(p) for p in PROMPTS]
    return torch.tensor([16, 17]), AttentionMetadata.build([1, 1], ctx, TABLES, BLOCK_SIZE)


@pytest.mark.parametrize("name,fields", _cases())
@torch.inference_mode()
def test_static_buffers_give_the_step_logits(name, fields):
    model = tiny_model(name, fields)
    why = cuda_graph.model_refusal(model)
    if why is not None:
        pytest.skip(f"{name} {fields}: never captured ({why}), its decode steps run eagerly")
    c = model.config
    kv = KVCache(len(model.transformer.layers), 8, BLOCK_SIZE, c.num_key_value_heads, c.head_size, model.dtype)
    with dispatch.kernels_mode("triton"):
        ids, meta = _decode_pair(model, kv)
        ref = model.eager_forward(ids, meta, kv).float()
        graph = cuda_graph.DecodeGraph(model, 2, kv)
        graph.load(ids, meta)
        assert graph.tables.shape == (2, 8) and graph.kv_lens.tolist() == meta.kv_lens
        ours = model.eager_forward(graph.ids, graph.static_meta(), kv).float()
    bound = E2E_TOL * max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= bound


def test_stale_kv_lens_in_the_buffers_show():
    """The buffers are what the kernels read: kv_lens one short gives other logits (the test can fail)."""
    model = tiny_model("LlamaForCausalLM", {})
    c = model.config
    kv = KVCache(len(model.transformer.layers), 8, BLOCK_SIZE, c.num_key_value_heads, c.head_size, model.dtype)
    with torch.inference_mode(), dispatch.kernels_mode("triton"):
        ids, meta = _decode_pair(model, kv)
        ref = model.eager_forward(ids, meta, kv).float()
        graph = cuda_graph.DecodeGraph(model, 2, kv)
        graph.load(ids, meta)
        graph.kv_lens -= 1
        ours = model.eager_forward(graph.ids, graph.static_meta(), kv).float()
    assert (ours - ref).abs().max().item() > 100 * E2E_TOL * max(1.0, ref.abs().max().item())


def test_refusals():
    """What a graph cannot follow runs eagerly, and says why."""
    llama = tiny_model("LlamaForCausalLM", {})
    decode = AttentionMetadata.build([1], [3], [[0]], BLOCK_SIZE)
    assert cuda_graph.refusal(llama, torch.zeros(1), decode) == "not a CUDA decode step"  # a CPU step
    assert cuda_graph.model_refusal(llama) is None
    glm = dict(num_key_value_heads=3, bos_token_id=98, mask_token_id=99, gmask_token_id=100)
    assert cuda_graph.model_refusal(tiny_model("ChatGLMForCausalLM", glm)) == "a prefix-LM mask"
    falcon = dict(position_embedding_type="alibi_with_scale", num_key_value_heads=3, qkv_bias=True,
                  dense_bias=True, mlp_bias=True)
    assert cuda_graph.model_refusal(tiny_model("FalconForCausalLM", falcon)).startswith("a key bias")
