"""The shared fused-qkv postprocess hooks: whole source -> each tp rank's [Q_r; K_r; V_r] rows."""

from __future__ import annotations

import pytest
import torch

from bestiary.core.convert.postprocess import fused_qkv, fused_qkv_transposed, per_head_qkv
from bestiary.core.format.config import Mapping, PretrainedConfig


def config(heads: int, kv_heads: int, tp: int) -> PretrainedConfig:
    return PretrainedConfig(architecture="X", dtype="float32", vocab_size=8, hidden_size=heads * 4,
                            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            hidden_act="silu", mapping=Mapping(tp_size=tp))


def head_major(heads: int, kv_heads: int, d: int = 4, hidden: int = 16) -> torch.Tensor:
    """[Q; K; V] rows numbered so every row says which head of which part it is."""
    rows = [(part, h) for part, n in ((0, heads), (1, kv_heads), (2, kv_heads)) for h in range(n) for _ in range(d)]
    return torch.tensor([[100 * part + h] * hidden for part, h in rows], dtype=torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 4, 2), (4, 2, 2), (4, 1, 2), (8, 2, 4)])
def test_every_rank_gets_its_heads(heads, kv_heads, tp):
    whole = head_major(heads, kv_heads)  # [(H + 2 KVH) D, hidden]
    c = config(heads, kv_heads, tp)
    for rank in range(tp):
        out = fused_qkv("k", [whole], c, tp_rank=rank)["k"]
        ids = out[:, 0].reshape(-1, 4)[:, 0].tolist()  # one id per head row-block
        q = [h for h in range(heads) if h * tp // heads == rank]
        kv = [h * kv_heads // heads for h in q]
        kv = sorted(set(kv))
        assert ids == q + [100 + h for h in kv] + [200 + h for h in kv]
        assert torch.equal(fused_qkv_transposed("k", [whole.t().contiguous()], c, tp_rank=rank)["k"], out)
        bias = whole[:, 0]
        assert torch.equal(fused_qkv_transposed("b", [bias], c, tp_rank=rank)["b"], out[:, 0])


def test_per_head_layout_is_reordered():
    heads, d = 4, 4
    whole = head_major(heads, heads)
    per_head = whole.reshape(3, heads, d, -1).transpose(0, 1).reshape(whole.shape)  # [q_h k_h v_h] per head
    c = config(heads, heads, 2)
    for rank in range(2):
        assert torch.equal(per_head_qkv("k", [per_head], c, tp_rank=rank)["k"], fused_qkv("k", [whole], c, tp_rank=rank)["k"])
