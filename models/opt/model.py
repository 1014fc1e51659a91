"""OPT: learned positions, LayerNorm pre- or post-norm layers, MHA with biases, ReLU MLP.

    x   = project_in(vocab_embedding(ids)) + position_embedding(positions)   # project_in: P -> H
    x   = layers(x)                       # PreNormDecoderLayer or PostNormDecoderLayer
    out = lm_head(project_out(ln_f(x)))   # ln_f: pre-norm models only; project_out: H -> P

P = word_embed_proj_dim (the token embedding / lm_head width), H = hidden_size; the
projections exist only when P != H (OPT-350m).
"""

from __future__ import annotations

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

    def make_top_level_modules(self, device) -> dict[str, nn.Module]:
        """position_embedding and project_in on the first stage, project_out on the last (P != H only)."""
        c, place = self.config, {"dtype": self.dtype, "device": device}
        extra: dict[str, nn.Module] = {}
        if self.is_first_stage:
            extra["position_embedding"] = LearnedPositionEmbedding(
                c.max_position_embeddings or 2048, c.hidden_size, c.position_offset, **place)
            if self.projected:
                extra["project_in"] = Linear(c.word_embed_proj_dim, c.hidden_size, **place)
        if self.is_last_stage and self.projected:
            extra["project_out"] = Linear(c.hidden_size, c.word_embed_proj_dim, **place)
        return extra

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
