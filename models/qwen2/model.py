"""Qwen2's config and model: the shared RMSNorm / RoPE / GQA / SwiGLU layer with q/k/v biases.

    h   = x + o(attention(q, k, v of RMSNorm(x)))     q, k, v with biases, o without
    out = h + down(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))

Sliding window (HF `use_sliding_window: true`): the layers HF's config marks "sliding_attention"
attend to the last `sliding_window` keys (query included), the others to every key
(DecoderLM.attention_window reads sliding_window and layer_types: core.layers.attention_window).
Without an explicit `layer_types`, transformers' Qwen2Config windows layer i when
i >= max_window_layers (default 28); Qwen2-MoE has its own rule (models.qwen2_moe.model).
Without use_sliding_window, `sliding_window` is ignored (HF sets it to None), as in every
published Qwen2 / Qwen2.5 config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from bestiary.core.format.hf_config import DecoderConfig, first_present, hf_config_reader
from bestiary.core.layers.standard_layer import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM
from pydantic import Field, model_validator
from torch import nn

LayerType = Literal["sliding_attention", "full_attention"]
MAX_WINDOW_LAYERS = 28  # HF Qwen2Config / Qwen2MoeConfig max_window_layers default


class WindowFields(DecoderConfig):
    """DecoderConfig + the per-layer sliding window of the Qwen2 family (Qwen2, Qwen2-MoE)."""

    sliding_window: int | None = Field(
        None, ge=1, description="HF sliding_window when use_sliding_window is set (None: no window layers).")
    layer_types: list[LayerType] | None = Field(
        None, description="Per layer: sliding_attention (through the window) or full_attention (every key).")

    @model_validator(mode="after")
    def _layer_count(self) -> WindowFields:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        return self


class Qwen2Config(WindowFields):
    """DecoderConfig with Qwen2's name, its fixed biases (q/k/v only) and its sliding window."""

    architecture: Literal["Qwen2ForCausalLM"] = "Qwen2ForCausalLM"
    qkv_bias: bool = True


def sliding_window(hf: dict) -> int | None:
    """HF sliding_window when use_sliding_window is true, else None (HF: None for Qwen2, 0 for Qwen2-MoE)."""
    return (hf.get("sliding_window") or None) if hf.get("use_sliding_window") else None


def window_layer_types(windowed: Callable[[int, dict], bool]) -> Callable[[dict], list[str] | None]:
    """A reader of HF layer_types: the config's own list, else `windowed(i, hf)` per layer i; None
    without a window (every layer full)."""

    def read(hf: dict) -> list[str] | None:
        if sliding_window(hf) is None:
            return None
        if hf.get("layer_types"):
            return list(hf["layer_types"])
        n = first_present(hf, ("num_hidden_layers",))
        return ["sliding_attention" if windowed(i, hf) else "full_attention" for i in range(n)]

    return read


def max_window_layers(hf: dict) -> int:
    """HF max_window_layers (absent or null: transformers' default 28)."""
    value = hf.get("max_window_layers")
    return MAX_WINDOW_LAYERS if value is None else int(value)


def qwen2_windowed(i: int, hf: dict) -> bool:
    """transformers' Qwen2Config: layer i is windowed when i >= max_window_layers."""
    return i >= max_window_layers(hf)


from_hf_config = hf_config_reader(Qwen2Config, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 32768},
                                  qkv_bias=True, dense_bias=False, sliding_window=sliding_window,
                                  layer_types=window_layer_types(qwen2_windowed))


class Qwen2ForCausalLM(DecoderLM):
    """Qwen1.5 / Qwen2 / Qwen2.5 dense decoders."""

    config: Qwen2Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
