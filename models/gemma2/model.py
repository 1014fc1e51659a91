"""Gemma 2's config and model (transformers' Gemma2ForCausalLM).

    x   = embed_tokens(ids) * sqrt(hidden)           the scale rounded to the embedding dtype first
    h   = x + N(o(attention(q, k, v of N(x))))        scores c_a tanh(q k^T / sqrt(query_pre_attn_scalar) / c_a)
    out = h + N(down(gelu_tanh(gate(N(h))) * up(N(h))))   (core.layers.sandwich_norm_decoder_layer)
    logits = c_f tanh(lm_head(N(x)) / c_f)            lm_head tied to embed_tokens (HF's default)

N is RMSNorm with the scale 1 + w (each place its own w; core.layers.norm, offset 1). c_a / c_f:
attn_logit_softcapping / final_logit_softcapping (null: no cap). Layer i attends through the
sliding window when layer_types says "sliding_attention" (transformers' rule: the even layers).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import WindowFields, hf_config_reader, window_layer_types
from bestiary.core.layers.builder import standard_layer
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.runtime.model import DecoderLM

# transformers' Gemma2Config defaults for what a config.json may leave out (absent, not null).
HF_DEFAULTS: dict[str, Any] = {"attn_logit_softcapping": 50.0,
                               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256}


class GemmaFields(WindowFields):
    """WindowFields + what Gemma 2 and 3 add: the attention scale's query_pre_attn_scalar and two soft-caps."""

    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = Field(256.0, gt=0, description="Scores are scaled by its -1/2 power.")
    attn_logit_softcapping: float | None = Field(
        None, gt=0, description="c of the attention scores' soft-cap c tanh(s / c) (None: no cap).")
    final_logit_softcapping: float | None = Field(
        None, gt=0, description="c of the logits' soft-cap c tanh(l / c) (None: no cap).")


class Gemma2Config(GemmaFields):
    """GemmaFields with Gemma 2's name (its soft-caps come from the config, HF's 50 / 30 when absent)."""

    architecture: Literal["Gemma2ForCausalLM"] = "Gemma2ForCausalLM"


def hf_or_default(name: str, defaults: dict[str, Any]) -> Any:
    """A reader of HF field `name`: its value when present (null stays null: no cap, no window), else
    the HF config class's default."""
    return lambda hf: hf.get(name, defaults[name])


def local_window(hf: dict) -> int:
    """sliding_window (absent: 4096). Null is refused: transformers' Gemma masks need a window on the local layers."""
    window = hf.get("sliding_window", 4096)
    if window is None:
        raise ValueError("field 'sliding_window' is null: Gemma's local layers need a window")
    return window


def gemma2_windowed(i: int, hf: dict) -> bool:
    """Gemma2Config's pattern: layer i is local (sliding) when i is even."""
    return i % 2 == 0


GEMMA_FIELDS: dict[str, Any] = {"hidden_act": lambda hf: hf.get("hidden_activation") or "gelu_pytorch_tanh"}
CAUSAL_ONLY = {"use_bidirectional_attention": False}

from_hf_config = hf_config_reader(
    Gemma2Config, defaults={"norm_epsilon": 1e-6, "head_size": 256, "max_position_embeddings": 8192,
                            "tie_word_embeddings": True}, unsupported=CAUSAL_ONLY, copy_same_named=False,
    **GEMMA_FIELDS, **{n: hf_or_default(n, HF_DEFAULTS) for n in HF_DEFAULTS}, sliding_window=local_window,
    layer_types=window_layer_types(local_window, gemma2_windowed))


def gemma_norm(model: DecoderLM, device, size: int | None = None) -> RMSNorm:
    """RMSNorm with the scale 1 + w over `size` (default hidden_size) and the config's epsilon."""
    return RMSNorm(size or model.config.hidden_size, model.config.norm_epsilon, model.dtype, device, offset=1.0)


class Gemma2ForCausalLM(DecoderLM):
    """Gemma 2 2B / 9B / 27B."""

    config: GemmaFields

    def __init__(self, config: GemmaFields, rank: int = 0, device="meta") -> None:
        super().__init__(config, rank, device)
        self.embedding_scale = config.hidden_size**0.5
        self.logit_softcap = config.final_logit_softcapping

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        return standard_layer(self, device, layout="sandwich", scale=c.query_pre_attn_scalar**-0.5,
                              softcap=c.attn_logit_softcapping)

    def make_final_norm(self, device) -> nn.Module:
        return gemma_norm(self, device)
