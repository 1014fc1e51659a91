"""DeepSeek-V2 / V3's configs and model: latent attention (MLA), then a dense or a routed MoE block.

    x   = embed_tokens(ids)
    h   = x + MLA(RMSNorm(x))          core.layers.latent_attention: the cache holds [c_kv ; k_rope] per token
    out = h + mlp(y),  y = RMSNorm(h)  mlp = SwiGLU of intermediate_size in the first first_k_dense_replace
                                       layers (and off the moe_layer_freq beat), else
                                       routed(y) + shared(y)   (core.layers.moe_routing)
    logits = lm_head(RMSNorm(x))

MLA: q from q_proj (V2-Lite) or q_b_proj(RMSNorm(q_a_proj)); [c ; k_r] = kv_a_proj_with_mqa, c normed;
rope on q_r and k_r only (qk_rope_head_dim): V2 rotates interleaved pairs (gptj), V3 too unless its
rope_interleave is false (neox); score scale (qk_nope + qk_rope)^-1/2, times m(s, mscale_all_dim)^2
under YaRN (m(s, c) = 0.1 c ln s + 1, core.layers.yarn). Routing: V2 softmax scores, greedy or
group-limited (group = its best score); V3 sigmoid scores, choice on scores + e_score_correction_bias,
group = sum of its two best, weights from the unbiased scores renormalised (norm_topk_prob); both
times routed_scaling_factor.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.errors import ConfigError
from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.layers.kv_geometry import KVPoolGeometry
from bestiary.core.layers.latent_attention import MultiHeadLatentAttention, latent_pool_geometry
from bestiary.core.layers.mlp import GatedMLP
from bestiary.core.layers.moe_routing import GroupRoutedMoE, GroupRouting, SharedExpertsMoE
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.yarn import yarn_factor, yarn_mscale
from bestiary.core.runtime.model import DecoderLM


class DeepseekConfig(DecoderConfig):
    """DecoderConfig + MLA's dims and DeepSeek's MoE; intermediate_size is the dense layers' FFN dim.

    head_size is qk_nope_head_dim + qk_rope_head_dim (a query / key head); num_key_value_heads equals
    the query heads (MLA has no kv heads: the pool holds one latent row, `kv_pool_geometry`)."""

    q_lora_rank: int | None = Field(None, ge=1, description="Rank of q's low-rank path (None: one q_proj).")
    kv_lora_rank: int = Field(512, ge=1, description="Rank r of the cached KV latent c_kv.")
    qk_nope_head_dim: int = Field(128, ge=1, description="Per-head query / key dims without rope.")
    qk_rope_head_dim: int = Field(64, ge=2, description="Per-head query dims and shared key dims with rope.")
    v_head_dim: int = Field(128, ge=1, description="Per-head value dims.")
    num_local_experts: int = Field(64, ge=1, description="Routed experts per MoE layer (HF n_routed_experts).")
    num_experts_per_tok: int = Field(6, ge=1, description="Experts each token is routed to (top-k).")
    moe_intermediate_size: int = Field(1407, ge=1, description="FFN dim of one routed / shared expert.")
    n_shared_experts: int = Field(0, ge=0, description="Always-on shared experts (one MLP of n x that dim).")
    first_k_dense_replace: int = Field(0, ge=0, description="The first layers keep a dense MLP.")
    moe_layer_freq: int = Field(1, ge=1, description="After them, every n-th layer is a MoE layer.")
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = Field(
        "greedy", description="Expert choice: greedy top-k, group-limited (V2), or V3's noaux_tc.")
    n_group: int = Field(1, ge=1, description="Expert groups (group-limited routing).")
    topk_group: int = Field(1, ge=1, description="Groups kept per token.")
    norm_topk_prob: bool = Field(False, description="Renormalise the top-k weights to sum to 1.")
    routed_scaling_factor: float = Field(1.0, gt=0.0, description="Routed experts' weights times this.")

    def kv_pool_geometry(self, tp_size: int, tp_rank: int) -> KVPoolGeometry:
        """One row [c_kv ; k_rope] of kv_lora_rank + qk_rope_head_dim per token on every rank, no V pool."""
        return latent_pool_geometry(self.kv_lora_rank, self.qk_rope_head_dim)

    def routing(self) -> GroupRouting:
        """How a MoE layer routes (core.layers.moe_routing)."""
        v3 = self.topk_method == "noaux_tc"
        grouped = self.topk_method != "greedy"
        return GroupRouting(scoring="sigmoid" if v3 else "softmax",
                            group_score="top2_sum" if v3 else "max" if grouped else "none",
                            n_group=self.n_group if grouped else 1, topk_group=self.topk_group if grouped else 1,
                            renormalize=self.norm_topk_prob, scale=self.routed_scaling_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: layer_idx >= first_k_dense_replace and layer_idx % moe_layer_freq == 0."""
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


class DeepseekV2Config(DeepseekConfig):
    """DeepSeek-V2: softmax routing, greedy or group-limited; rope on interleaved pairs."""

    architecture: Literal["DeepseekV2ForCausalLM"] = "DeepseekV2ForCausalLM"
    position_embedding_type: Literal["rope_gptj"] = "rope_gptj"
    topk_method: Literal["greedy", "group_limited_greedy"] = "greedy"


class DeepseekV3Config(DeepseekConfig):
    """DeepSeek-V3: sigmoid scores + correction bias, noaux_tc groups; rope interleaved unless rope_interleave false."""

    architecture: Literal["DeepseekV3ForCausalLM"] = "DeepseekV3ForCausalLM"
    topk_method: Literal["noaux_tc"] = "noaux_tc"


def _count(name: str, default: int | None) -> Any:
    """A reader of an HF size field that may be null (the HF class's default then)."""
    return lambda hf: hf[name] if hf.get(name) is not None else default


# transformers' DeepseekV2Config / DeepseekV3Config defaults, for fields a source leaves out.
COMMON: dict[str, Any] = dict(
    num_key_value_heads=lambda hf: hf["num_attention_heads"],
    head_size=lambda hf: _count("qk_nope_head_dim", 128)(hf) + _count("qk_rope_head_dim", 64)(hf),
    q_lora_rank=lambda hf: hf["q_lora_rank"] if "q_lora_rank" in hf else 1536)
from_hf_config_v2 = hf_config_reader(
    DeepseekV2Config, defaults={"norm_epsilon": 1e-6},
    # transformers 5 drops V2's norm_topk_prob (DeepSeek's own code renormalises and skips the scaling).
    unsupported={"norm_topk_prob": False, "scoring_func": "softmax"},
    **COMMON, num_local_experts=_count("n_routed_experts", 64), num_experts_per_tok=_count("num_experts_per_tok", 6),
    n_shared_experts=lambda hf: (hf["n_shared_experts"] or 0) if "n_shared_experts" in hf else 2,
    first_k_dense_replace=_count("first_k_dense_replace", 0),
    topk_method=lambda hf: hf.get("topk_method") or "greedy",
    n_group=_count("n_group", 1), topk_group=_count("topk_group", 1))
from_hf_config_v3 = hf_config_reader(
    DeepseekV3Config, defaults={"norm_epsilon": 1e-6, "max_position_embeddings": 4096},
    unsupported={"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    **COMMON, num_local_experts=_count("n_routed_experts", 256), num_experts_per_tok=_count("num_experts_per_tok", 8),
    moe_intermediate_size=_count("moe_intermediate_size", 2048),
    n_shared_experts=lambda hf: (hf["n_shared_experts"] or 0) if "n_shared_experts" in hf else 1,
    first_k_dense_replace=_count("first_k_dense_replace", 3), n_group=_count("n_group", 8),
    topk_group=_count("topk_group", 4), norm_topk_prob=lambda hf: hf.get("norm_topk_prob") is not False,
    routed_scaling_factor=lambda hf: hf.get("routed_scaling_factor") or 2.5,
    position_embedding_type=lambda hf: "rope_gpt_neox" if hf.get("rope_interleave") is False else "rope_gptj")


class DeepseekV2ForCausalLM(DecoderLM):
    """DeepSeek-V2 / V2-Lite / V2.5 (and V3 below): MLA + dense-then-MoE layers."""

    config: DeepseekConfig

    def __init__(self, config: DeepseekConfig, rank: int = 0, device="meta") -> None:
        algo = config.quantization.kv_cache_quant_algo
        if algo:
            raise ConfigError(f"--{str(getattr(algo, 'value', algo)).lower()}_kv_cache: {config.architecture}'s latent "
                              "KV cache (multi-head latent attention) runs unquantized only")
        super().__init__(config, rank, device)
        # its attention reads each step's lengths from Python (core.runtime.cuda_graph runs such steps eagerly)
        self.__dict__["cuda_graph_refusal"] = "multi-head latent attention (its torch path reads each step's lengths)"

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device, attention=self.make_attention(device), mlp=self.make_mlp(layer_idx, device))

    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-1/2, times m(s, mscale_all_dim)^2 under a rope scaling that sets mscale_all_dim."""
        c, scaling = self.config, self.config.rotary_scaling or {}
        scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
        if scaling.get("rope_type", scaling.get("type")) not in (None, "default") and scaling.get("mscale_all_dim"):
            factor = yarn_factor(scaling, c.max_position_embeddings or 2048)  # `factor`, else max / original positions
            scale *= yarn_mscale(factor, float(scaling["mscale_all_dim"])) ** 2
        return scale

    def make_attention(self, device) -> MultiHeadLatentAttention:
        c = self.config
        style = "gptj" if c.position_embedding_type == "rope_gptj" else "neox"
        rotary = Rotary(c.qk_rope_head_dim, c.qk_rope_head_dim, c.rotary_base, c.rotary_scaling,
                        c.max_position_embeddings or 2048, style=style)
        return MultiHeadLatentAttention(c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                                        c.qk_rope_head_dim, c.v_head_dim, rotary, c.q_lora_rank, self.softmax_scale(),
                                        bias=c.dense_bias, **self.placement(device))

    def make_mlp(self, layer_idx: int, device) -> nn.Module:
        c, place = self.config, self.placement(device)
        if not c.is_moe_layer(layer_idx):
            assert c.intermediate_size is not None  # the HF reader always sets it
            return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, **place)
        experts = GroupRoutedMoE(c.hidden_size, c.moe_intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                 c.routing(), c.hidden_act, ep_size=c.mapping.moe_sizes()[1],
                                 correction_bias=c.topk_method == "noaux_tc", **place)
        shared = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, c.hidden_act, c.mlp_bias,
                          **place) if c.n_shared_experts else None
        return SharedExpertsMoE(experts, shared)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's layers with V3's routing (sigmoid, correction bias, noaux_tc groups)."""

    config: DeepseekV3Config
