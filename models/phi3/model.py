"""Phi-3's config and model (Phi-3 mini / medium, 4k and 128k, Phi-3.5-mini, Phi-4, Phi-4-mini).

    x   = vocab_embedding(ids)
    h   = x + o(attention(q, k, v of RMSNorm(x)))   q, k, v: rows of the fused qkv_proj; GQA; neox RoPE
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))   gate, up: the halves of gate_up_proj
    logits = lm_head(RMSNorm(x))                    tied to vocab_embedding when HF ties them (Phi-4-mini)

RoPE over the first rotary_pct of each head (Phi-4-mini: 0.75), either the default one or LongRoPE
(core.layers.longrope): per-pair short / long frequency divisors, the long ones for a sequence longer
than original_max_position_embeddings, and cos / sin scaled by sqrt(1 + ln(s) / ln(original)).
With HF `sliding_window` W every layer attends to the last W keys, its own included (as Mistral).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from bestiary.core.format.errors import ConfigError
from bestiary.core.format.hf_config import WindowFields, hf_config_reader, read_rope
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.layers.longrope import LongRope
from bestiary.core.runtime.model import DecoderLM

ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config's original_max_position_embeddings default


class Phi3Config(WindowFields):
    """DecoderConfig (LongRoPE in rotary_scaling, rotary_pct, tied lm_head) + the window of every layer."""

    architecture: Literal["Phi3ForCausalLM"] = "Phi3ForCausalLM"


def phi3_rotary_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling as Phi3Config reads it: "su" and "yarn" are old names of longrope, and the
    top-level original_max_position_embeddings (default 4096) is the switch length."""
    rope = read_rope(hf)
    scaling = rope["rotary_scaling"]
    if scaling is None:
        return None
    original = hf.get("original_max_position_embeddings") or ORIGINAL_MAX_POSITIONS
    kept = {k: v for k, v in scaling.items() if k not in ("type", "rope_type", "original_max_position_embeddings")}
    scaling = kept | {"rope_type": "longrope", "original_max_position_embeddings": original}
    rot_dim = int(hf["hidden_size"] // hf["num_attention_heads"] * rope["rotary_pct"])  # as Phi3Config checks it
    try:  # factor lists of rot_dim/2 numbers
        LongRope.of(rot_dim, rope["rotary_base"], scaling, hf.get("max_position_embeddings") or 4096)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    return scaling


from_hf_config = hf_config_reader(
    Phi3Config, defaults={"norm_epsilon": 1e-5, "max_position_embeddings": 4096},
    rope_kinds=("longrope", "su", "yarn"), rotary_scaling=phi3_rotary_scaling)


class Phi3ForCausalLM(DecoderLM):
    """One (tp, pp) rank of a Phi-3 / Phi-4 decoder."""

    config: Phi3Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)  # the config's rotary: LongRoPE when rotary_scaling says so

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
