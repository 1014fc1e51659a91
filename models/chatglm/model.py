"""ChatGLM's configs and models, v1 and v2/3, from the shared layer (core.layers.builder).

v2/3 (chatglm2/3-6b, HF glm / GLM-4): LLaMA's pre-norm block with a partial interleaved rotary:
    x   = word_embeddings(ids)
    h   = x + dense(attention(q, k, v of RMSNorm(x)))   gptj RoPE on the first rotary_pct of each head, GQA
    out = h + dense_4h_to_h(silu(gate(RMSNorm(h))) * up(RMSNorm(h)))     gate, up: halves of dense_h_to_4h
    logits = output_layer(RMSNorm(x))

v1 (chatglm-6b), per layer l of L, alpha = sqrt(2 L) (the scaled layout):
    a = LN_in(x);   h = a * alpha + attention(a)
    m = LN_post(h); y = m * alpha + dense_4h_to_h(gelu_tanh(dense_h_to_4h(m)))
    logits = lm_head(LN_f(y of the last layer))
with 2D rotary positions and a prefix-LM mask (see `glm_positions`). THUDM scales the
scores by 1/(sqrt(D) (l+1)) and multiplies them back by (l+1) before the softmax: the
same softmax(q k^T / sqrt(D)), so attention here uses the plain scale.

Config readers use the defaults of the config class that wrote the file: THUDM's remote
`configuration_chatglm.py` (v1: chatglm-6b, v2/3: chatglm2-6b / chatglm3-6b) and
transformers' `GlmConfig` (model_type "glm").
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from bestiary.core.format.config import Mapping
from bestiary.core.format.hf_config import DecoderConfig, first_present, hf_config_reader
from bestiary.core.layers.builder import layer_norm, rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM


class ChatGLMConfig(DecoderConfig):
    """ChatGLM v1 (chatglm-6b): scaled post-norm residuals, GELU, 2D rotary, prefix-LM mask, biases everywhere."""

    architecture: Literal["ChatGLMForCausalLM"] = "ChatGLMForCausalLM"
    hidden_act: str = "gelu_new"
    position_embedding_type: Literal["chatglm"] = "chatglm"
    qkv_bias: bool = True
    dense_bias: bool = True
    mlp_bias: bool = True
    # Token ids: integers (strict: JSON `true` is not token 1), within any vocabulary.
    bos_token_id: int = Field(
        150004, ge=0, le=2**24, strict=True,
        description="Token that ends the bidirectional context; the generated span starts with it."
    )
    mask_token_id: int = Field(150000, ge=0, le=2**24, strict=True,
                               description="[MASK]: the span position when no [gMASK] is in the context.")
    gmask_token_id: int = Field(150001, ge=0, le=2**24, strict=True,
                                description="[gMASK]: the generated span takes its position.")


class ChatGLM2Config(DecoderConfig):
    """ChatGLM2/3 and GLM-4 (HF `glm`): RMSNorm, SwiGLU, GQA, interleaved rotary on part of each head."""

    architecture: Literal["ChatGLM2ForCausalLM"] = "ChatGLM2ForCausalLM"
    position_embedding_type: Literal["rope_gptj"] = "rope_gptj"
    rotary_pct: float = Field(0.5, gt=0.0, le=1.0, description="Fraction of head dims rotated (partial_rotary_factor).")
    qkv_bias: bool = True
    multi_query_attention: bool = Field(
        True,
        description="THUDM layout of a fused query_key_value source: [Q; K; V] (true) or [q, k, v] per head "
        "(false, which also means num_key_value_heads == num_attention_heads).",
    )

    @model_validator(mode="after")
    def _check_rotary(self) -> ChatGLM2Config:
        assert self.head_size is not None  # set by PretrainedConfig._derive (validated before this subclass's check)
        if int(self.head_size * self.rotary_pct) % 2 or self.rotary_dim == 0:
            raise ValueError(
                f"head_size {self.head_size} * rotary_pct {self.rotary_pct} must be a positive even number"
            )
        if not self.multi_query_attention and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("multi_query_attention false needs num_key_value_heads == num_attention_heads")
        return self


# THUDM options with no bestiary counterpart: quantized checkpoints and P-tuning prefixes.
THUDM_UNSUPPORTED = {"quantization_bit": 0, "pre_seq_len": None}

# Biases: the class's (all true); bos / mask / gmask token ids: same-named HF fields.
from_hf_config_v1 = hf_config_reader(
    ChatGLMConfig, unsupported={**THUDM_UNSUPPORTED, "position_encoding_2d": True}, rope_kinds=(),
    defaults=dict(vocab_size=150528, hidden_size=4096, num_hidden_layers=28, num_attention_heads=32,
                  intermediate_size=16384, max_position_embeddings=2048, norm_epsilon=1e-5, hidden_act="gelu_new"),
    intermediate_size=lambda hf: first_present(hf, ("inner_hidden_size",)) or 16384, hidden_act="gelu_new")


def thudm_kv_heads(hf: dict) -> int:
    """multi_query_group_num (default 1) with multi_query_attention, else one per query head."""
    heads = first_present(hf, ("num_attention_heads",)) or 32
    return (first_present(hf, ("multi_query_group_num",)) or 1) if hf.get("multi_query_attention") else heads


def thudm_linear_bias(hf: dict) -> bool:
    """THUDM add_bias_linear: a bias on attention dense and the MLP (and on qkv)."""
    return bool(hf.get("add_bias_linear", False))


thudm_v2 = hf_config_reader(
    ChatGLM2Config, rope_kinds=(),
    unsupported={**THUDM_UNSUPPORTED, "rmsnorm": True, "post_layer_norm": True,
                 "apply_residual_connection_post_layernorm": False},
    defaults=dict(vocab_size=65024, hidden_size=4096, num_hidden_layers=28, num_attention_heads=32, head_size=128,
                  intermediate_size=13696, max_position_embeddings=2048, norm_epsilon=1e-5, rotary_pct=0.5),
    vocab_size=lambda hf: first_present(hf, ("padded_vocab_size",)) or 65024, num_key_value_heads=thudm_kv_heads,
    rotary_base=lambda hf: 10000.0 * float(first_present(hf, ("rope_ratio",)) or 1),
    rotary_pct=0.5, qkv_bias=lambda hf: thudm_linear_bias(hf) or bool(hf.get("add_qkv_bias", False)),
    dense_bias=thudm_linear_bias, mlp_bias=thudm_linear_bias,
    multi_query_attention=lambda hf: bool(hf.get("multi_query_attention", False)),
    tie_word_embeddings=False)  # THUDM's output_layer is never tied to the embedding


def glm_head_size(hf: dict) -> int:
    """HF head_dim: absent -> GlmConfig's 128, null -> hidden_size / heads."""
    if "head_dim" not in hf:
        return 128
    hidden, heads = first_present(hf, ("hidden_size",)) or 4096, first_present(hf, ("num_attention_heads",)) or 32
    return hf["head_dim"] or hidden // heads


hf_glm = hf_config_reader(
    ChatGLM2Config, rope_kinds=(),
    defaults=dict(vocab_size=151552, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
                  num_key_value_heads=2, intermediate_size=13696, max_position_embeddings=131072,
                  norm_epsilon=1.5625e-07, rotary_pct=0.5),
    head_size=glm_head_size, qkv_bias=lambda hf: first_present(hf, ("attention_bias",)) is not False, dense_bias=False,
    mlp_bias=False, multi_query_attention=True)


def from_hf_config_v2(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> ChatGLM2Config:
    """ChatGLM2Config from a THUDM chatglm2/3 config.json or a transformers `glm` one."""
    return (hf_glm if hf.get("model_type") == "glm" else thudm_v2)(hf, dtype, mapping, source)


class ChatGLM2ForCausalLM(DecoderLM):
    """ChatGLM2/3 and GLM-4 (THUDM and HF glm naming)."""

    config: ChatGLM2Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)


def glm_positions(tokens: list[int], bos: int, mask: int, gmask: int) -> tuple[int, int]:
    """(context_length, mask_position) of a ChatGLM v1 sequence.

    context_length: index of the first bos (the context is everything before it); the
      whole sequence when it has no bos (then nothing is generated into a mask slot).
    mask_position: index of the first [gMASK] in the context, else of the first [MASK],
      else context_length (THUDM's code raises there).
    Token j then has position p_j = j for j < context_length else mask_position, and
    block position b_j = 0 for j < context_length else j - context_length + 1.
    """
    ctx = tokens.index(bos) if bos in tokens else len(tokens)
    context = tokens[:ctx]
    for marker in (gmask, mask):
        if marker in context:
            return ctx, context.index(marker)
    return ctx, ctx


class ChatGLMForCausalLM(DecoderLM):
    """ChatGLM v1 (chatglm-6b): 2D rotary, prefix-LM mask, scaled post-norm residuals, GELU MLP."""

    config: ChatGLMConfig
    mask_kind = "prefix_lm"

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        alpha = math.sqrt(2 * self.config.num_hidden_layers)
        return standard_layer(self, device, gated=False, layout="scaled", alpha=alpha)

    def make_final_norm(self, device) -> nn.Module:
        return layer_norm(self, device)

    def _context(self, tokens: list[int]) -> tuple[int, int]:
        c = self.config
        return glm_positions(tokens, c.bos_token_id, c.mask_token_id, c.gmask_token_id)

    def prefix_len(self, tokens: list[int]) -> int:
        """The context (every token before the first bos) is attended bidirectionally; no bos: causal."""
        ctx, _ = self._context(tokens)
        return ctx if ctx < len(tokens) else 0

    def position_ids(self, tokens: list[int], start: int, count: int) -> torch.Tensor:
        """[2, count]: (position, block position) of tokens[start:start+count] (see `glm_positions`)."""
        ctx, mask_pos = self._context(tokens)
        j = torch.arange(start, start + count, dtype=torch.int64)
        in_context = j < ctx
        pos = torch.where(in_context, j, torch.full_like(j, mask_pos))
        block = torch.where(in_context, torch.zeros_like(j), j - ctx + 1)
        return torch.stack([pos, block])  # [2, count]
