"""EXAONE 4.0's config and model (transformers 5's Exaone4ForCausalLM).

    x   = embed_tokens(ids)
    h   = x + RMSNorm(o(attention(q_norm(q), k_norm(k), v)))   q/k norms over each head's D dims
    out = h + RMSNorm(down(silu(gate(h)) * up(h)))            (core.layers.output_norm_decoder_layer)
    logits = lm_head(RMSNorm(x))                              tied to embed_tokens when HF ties them

Hybrid attention: with a sliding_window, "sliding_attention" layers use RoPE over a local window
and "full_attention" layers use no positions at all (NoPE); without one every layer uses RoPE.
The sliding layers attend through the window (DecoderLM.attention_window reads sliding_window
and layer_types: core.kernels.attention_window); sequences are not capped at it.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import (
    WindowFields,
    first_present,
    hf_config_reader,
    window_layer_types,
)
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM


class Exaone4Config(WindowFields):
    """DecoderConfig + EXAONE 4.0's window and per-layer attention kinds (sliding_attention: RoPE and
    the window; full_attention: NoPE over every key)."""

    architecture: Literal["Exaone4ForCausalLM"] = "Exaone4ForCausalLM"

    def uses_rope(self, layer_idx: int) -> bool:
        """RoPE on layer `layer_idx`: every layer without a window, else the sliding ones only."""
        return self.sliding_window is None or self.layer_types is None \
            or self.layer_types[layer_idx] == "sliding_attention"


def exaone4_windowed(i: int, hf: dict) -> bool:
    """Exaone4Config's pattern: layer i is global (full) when (i + 1) % pattern == 0, else local."""
    pattern = hf.get("sliding_window_pattern")
    if pattern is None:  # absent or null: Exaone4Config's 4
        pattern = 4
    if isinstance(pattern, str):  # "LLLG": L local, G global, repeated
        pattern = len(pattern)
    if pattern == 0:  # what Exaone4Config writes without a sliding_window (then this is never asked)
        raise ValueError("sliding_window_pattern 0 with a sliding_window: a pattern of 0 layers")
    return (i + 1) % pattern != 0


def max_positions(hf: dict) -> int:
    """max_position_embeddings (not capped by sliding_window: the sliding layers attend through it)."""
    return first_present(hf, ("max_position_embeddings",)) or 2048


from_hf_config = hf_config_reader(
    Exaone4Config, defaults={"norm_epsilon": 1e-5}, max_position_embeddings=max_positions,
    layer_types=window_layer_types(lambda hf: hf.get("sliding_window"), exaone4_windowed))


class Exaone4ForCausalLM(DecoderLM):
    """EXAONE 4.0 1.2B / 32B."""

    config: Exaone4Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device, rotary=self.config.uses_rope(layer_idx), qk_norm=True, layout="output")

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
