"""OPT: learned positions, LayerNorm pre- or post-norm layers, MHA with biases, ReLU MLP.

    x   = project_in(vocab_embedding(ids)) + position_embedding(positions)   # project_in: P -> H
    x   = layers(x)                       # PreNormDecoderLayer or PostNormDecoderLayer
    out = lm_head(project_out(ln_f(x)))   # ln_f: pre-norm models only; project_out: H -> P

P = word_embed_proj_dim (the token embedding / lm_head width), H = hidden_size; the
projections exist only when P != H (OPT-350m).
"""

from __future__ import annotations

import torch
from bestiary.core.layers.attention import AttentionMetadata
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.linear import Linear
from bestiary.core.layers.mlp import MLP
from bestiary.core.layers.norm import LayerNorm
from bestiary.core.layers.position_embedding import LearnedPositionEmbedding
from bestiary.core.layers.post_norm_decoder_layer import PostNormDecoderLayer
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.opt.config import OPTConfig
from torch import nn


class OPTForCausalLM(DecoderLM):
    """OPT 125m-66b (350m's projected embeddings and post-norm layers included)."""

    config: OPTConfig

    def __init__(self, config: OPTConfig, rank: int = 0, device: torch.device | str | None = "meta") -> None:
        super().__init__(config, rank, device)
        c, dtype = config, self.dtype
        if self.is_first_stage:
            self.transformer.position_embedding = LearnedPositionEmbedding(
                c.max_position_embeddings or 2048, c.hidden_size, c.position_offset, dtype, device)
            if self.projected:
                self.transformer.project_in = Linear(c.word_embed_proj_dim, c.hidden_size, dtype=dtype,
                                                     device=device)
                self.transformer.project_in.name = "transformer.project_in"
        if self.is_last_stage and self.projected:
            self.transformer.project_out = Linear(c.hidden_size, c.word_embed_proj_dim, dtype=dtype,
                                                  device=device)
            self.transformer.project_out.name = "transformer.project_out"

    @property
    def projected(self) -> bool:
        """Token embeddings are narrower/wider than the layers (OPT-350m): project_in/out exist."""
        return self.config.word_embed_proj_dim != self.config.hidden_size

    @property
    def embedding_dim(self) -> int:
        return self.config.word_embed_proj_dim

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)
        attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_attention_heads, c.head_size,
                                  qkv_bias=c.enable_bias, dense_bias=c.enable_bias,
                                  dtype=self.dtype, device=device, **tp)
        mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.enable_bias, dtype=self.dtype,
                  device=device, **tp)
        layer = PreNormDecoderLayer if c.do_layer_norm_before else PostNormDecoderLayer
        return layer(self._layer_norm(device), attention, self._layer_norm(device), mlp)

    def make_final_norm(self, device) -> nn.Module:
        return self._layer_norm(device) if self.config.has_final_norm else nn.Identity()

    def _layer_norm(self, device) -> LayerNorm:
        c = self.config
        return LayerNorm(c.hidden_size, c.norm_epsilon, bias=True, dtype=self.dtype, device=device)

    def embed(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """ids [T] -> project_in(W_tok[ids]) + W_pos[positions + offset]: [T, H]."""
        x = self.transformer.vocab_embedding(ids)  # [T, P]
        if self.projected:
            x = self.transformer.project_in(x)  # [T, H]
        return x + self.transformer.position_embedding(meta.positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> project_out -> [N, P] -> lm_head -> logits [N, V]."""
        if self.projected:
            hidden = self.transformer.project_out(hidden)
        return super().logits(hidden)
