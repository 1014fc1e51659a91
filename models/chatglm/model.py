"""ChatGLM v1 and v2/3 models, composed from core layers.

v2/3 (and HF glm): the pre-norm block of LLaMA with RMSNorm, SwiGLU, GQA and
interleaved (gptj-style) rotary on the first rotary_pct of each head.

v1 (chatglm-6b), per layer l of L, alpha = sqrt(2 L):
    a = LN_in(x);   h = a * alpha + attention(a)
    m = LN_post(h); y = m * alpha + mlp(m)          (mlp = dense_4h_to_h(gelu_tanh(dense_h_to_4h)))
with 2D rotary positions and a prefix-LM mask (see `glm_positions`). THUDM scales the
scores by 1/(sqrt(D) (l+1)) and multiplies them back by (l+1) before the softmax: the
same softmax(q k^T / sqrt(D)), so attention here uses the plain scale.
"""

from __future__ import annotations

import math

import torch
from bestiary.core.layers.attention import AttentionMetadata
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import MLP, GatedMLP
from bestiary.core.layers.norm import LayerNorm, RMSNorm
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.rotary_2d import Rotary2D
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.chatglm.config import ChatGLM2Config, ChatGLMConfig
from torch import nn


class ChatGLM2ForCausalLM(DecoderLM):
    """ChatGLM2/3 and GLM-4 (THUDM and HF glm naming)."""

    config: ChatGLM2Config

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = {"tp_rank": self.tp_rank, "tp_size": self.tp_size}
        rotary = Rotary(
            c.head_size, c.rotary_dim, c.rotary_base, None, c.max_position_embeddings or 2048, style="gptj"
        )
        attention = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_size,
            qkv_bias=c.qkv_bias,
            dense_bias=c.linear_bias,
            rotary=rotary,
            dtype=self.dtype,
            device=device,
            **tp,
        )
        mlp = GatedMLP(
            c.hidden_size,
            c.intermediate_size,
            c.hidden_act,
            c.linear_bias,
            dtype=self.dtype,
            device=device,
            **tp,
        )
        return PreNormDecoderLayer(self.make_final_norm(device), attention, self.make_final_norm(device), mlp)

    def make_final_norm(self, device) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.norm_epsilon, self.dtype, device)


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


class ScaledResidualLayer(nn.Module):
    """ChatGLM v1 block: residuals taken after the norm and scaled by alpha.

    a = input_layernorm(x);  h = a * alpha + attention(a)
    m = post_layernorm(h);   y = m * alpha + mlp(m)
    """

    def __init__(
        self,
        input_layernorm: nn.Module,
        attention: nn.Module,
        post_layernorm: nn.Module,
        mlp: nn.Module,
        alpha: float,
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention = attention
        self.post_layernorm = post_layernorm
        self.mlp = mlp
        self.alpha = alpha

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        a = self.input_layernorm(x)
        h = torch.add(self.attention(a, meta, k_pool, v_pool), a, alpha=self.alpha)
        m = self.post_layernorm(h)
        return torch.add(self.mlp(m, meta.lora), m, alpha=self.alpha)


class ChatGLMForCausalLM(DecoderLM):
    """ChatGLM v1 (chatglm-6b): 2D rotary, prefix-LM mask, scaled post-norm residuals, GELU MLP."""

    config: ChatGLMConfig
    mask_kind = "prefix_lm"

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = {"tp_rank": self.tp_rank, "tp_size": self.tp_size}
        rotary = Rotary2D(c.head_size, c.rotary_base, c.max_position_embeddings or 2048)
        attention = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_size,
            qkv_bias=True,
            dense_bias=True,
            rotary=rotary,
            dtype=self.dtype,
            device=device,
            **tp,
        )
        mlp = MLP(
            c.hidden_size, c.intermediate_size, c.hidden_act, True, dtype=self.dtype, device=device, **tp
        )
        alpha = math.sqrt(2 * c.num_hidden_layers)
        return ScaledResidualLayer(
            self.make_final_norm(device), attention, self.make_final_norm(device), mlp, alpha
        )

    def make_final_norm(self, device) -> nn.Module:
        return LayerNorm(self.config.hidden_size, self.config.norm_epsilon, True, self.dtype, device)

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
