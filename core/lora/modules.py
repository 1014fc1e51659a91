"""The LoRA module names and ids of TensorRT-LLM (TensorRT-LLM), and where each one lands.

A module name says which linear of a decoder layer an adapter adapts; the id is its number in
LoraConfig tensors. Each name lands on a canonical linear of layer i (`transformer.layers.{i}.` +
`section`), on all of its rows, on the rows of one head group of the fused qkv, or on one expert
of a stacked MoE linear:

    kind "whole"   B covers the linear's rows (a fused HF source goes through the architecture's
                   weight postprocess, e.g. Falcon's query_key_value row order)
    kind "q"/"k"/"v"  B covers the q / k / v rows of attention.qkv ([Q; K; V] head-major)
    kind "expert"  B covers expert e's rows of a stacked [E, out, in] expert linear

mlp_h_to_4h is the activated projection (gate_proj, canonical mlp.fc) and mlp_gate the
multiplied one (up_proj, canonical mlp.gate), as in TensorRT-LLM's HF module map.
"""

from __future__ import annotations

from typing import NamedTuple

MODULE_IDS: dict[str, int] = {
    "attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4,
    "mlp_h_to_4h": 5, "mlp_4h_to_h": 6, "mlp_gate": 7,
    "cross_attn_qkv": 8, "cross_attn_q": 9, "cross_attn_k": 10, "cross_attn_v": 11, "cross_attn_dense": 12,
    "moe_h_to_4h": 13, "moe_4h_to_h": 14, "moe_gate": 15, "moe_router": 16, "mlp_router": 17,
}


class Landing(NamedTuple):
    """Where a LoRA module lands in decoder layer i: `transformer.layers.{i}.{section}`, and how."""

    section: str
    kind: str  # "whole", "q", "k", "v" or "expert"


LANDINGS: dict[str, Landing] = {
    "attn_qkv": Landing("attention.qkv", "whole"),
    "attn_q": Landing("attention.qkv", "q"),
    "attn_k": Landing("attention.qkv", "k"),
    "attn_v": Landing("attention.qkv", "v"),
    "attn_dense": Landing("attention.dense", "whole"),
    "mlp_h_to_4h": Landing("mlp.fc", "whole"),
    "mlp_4h_to_h": Landing("mlp.proj", "whole"),
    "mlp_gate": Landing("mlp.gate", "whole"),
    "cross_attn_qkv": Landing("cross_attention.qkv", "whole"),
    "cross_attn_q": Landing("cross_attention.qkv", "q"),
    "cross_attn_k": Landing("cross_attention.qkv", "k"),
    "cross_attn_v": Landing("cross_attention.qkv", "v"),
    "cross_attn_dense": Landing("cross_attention.dense", "whole"),
    "moe_h_to_4h": Landing("mlp.fc", "expert"),
    "moe_4h_to_h": Landing("mlp.proj", "expert"),
    "moe_gate": Landing("mlp.gate", "expert"),
    "moe_router": Landing("mlp.router", "whole"),
    "mlp_router": Landing("mlp.shared_expert_gate", "whole"),
}
assert LANDINGS.keys() == MODULE_IDS.keys()


def module_id(name: str) -> int:
    """The id of LoRA module `name` (ValueError naming the known ones otherwise)."""
    try:
        return MODULE_IDS[name]
    except KeyError:
        raise ValueError(f"unknown LoRA module {name!r}; expected one of {', '.join(MODULE_IDS)}") from None
