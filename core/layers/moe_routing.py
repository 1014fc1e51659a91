"""DeepSeek's expert routing (V2: softmax scores, greedy or group-limited; V3: sigmoid scores with a
selection-only correction bias, noaux_tc) and its MoE block with always-on shared experts.

For a token with router logits l = W_r x [E] (float32), E experts in G groups of E / G, top-k K:

    s      = softmax(l) (V2)  or  sigmoid(l) (V3)                     the scores the weights come from
    c      = s + b        (V3: b = e_score_correction_bias [E])  or  s   the scores the choice is made on
    group  = max_{e in g} c_e (V2 group_limited_greedy)  or  the sum of the two largest c_e in g (V3 noaux_tc)
    c_e    = -inf for e outside the topk_group groups of largest `group`   (no grouping: greedy, G = 1)
    S      = the K experts of largest c_e
    w_e    = s_e                           for e in S (the unbiased score: b only steers the choice)
    w_e    = w_e / (sum_{j in S} w_j + 1e-20)    with norm_topk_prob
    w_e    = w_e * routed_scaling_factor
    y      = sum_{e in S} w_e expert_e(x) + shared(x)      shared: a GatedMLP of n_shared * I, no gate

(transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter; V2 masks the dropped groups' softmax scores
to 0 rather than -inf, which picks the same experts since every kept score is > 0 and K <= the kept
experts.) The router weight and the correction bias stay float32 (transformers keeps `gate.weight` and
`e_score_correction_bias` in float32) and are never quantized.

Checkpoint names, module `mlp` of a MoE layer: `mlp.experts` is the MoE (router `mlp.experts.router.weight`
[E, H], the stacked experts `mlp.experts.{fc,gate,proj}.weight`, `mlp.experts.e_score_correction_bias` [E]),
`mlp.shared_experts.{fc,gate,proj}.weight` the shared experts' GatedMLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bestiary.core.kernels.metadata import LoraDelta
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.mlp import GatedMLP
from bestiary.core.layers.moe import MoE


@dataclass(frozen=True)
class GroupRouting:
    """How DeepSeek routes (module docstring): `scoring` softmax / sigmoid, `group_score` none / max / top2_sum
    over n_group groups keeping topk_group, renormalize (norm_topk_prob), scale (routed_scaling_factor)."""

    scoring: str = "softmax"
    group_score: str = "none"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid") or self.group_score not in ("none", "max", "top2_sum"):
            raise ValueError(f"routing: scoring {self.scoring!r}, group_score {self.group_score!r}")
        if self.group_score != "none" and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")

    def check(self, num_experts: int, top_k: int) -> None:
        """ValueError unless the groups split the experts and the kept groups hold top_k of them."""
        if self.group_score == "none":
            return
        per_group = num_experts // self.n_group
        if num_experts % self.n_group or per_group < (2 if self.group_score == "top2_sum" else 1):
            raise ValueError(f"n_routed_experts {num_experts} does not split into n_group {self.n_group} groups "
                             f"of {2 if self.group_score == 'top2_sum' else 1} or more")
        if top_k > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok {top_k} > the {self.topk_group * per_group} experts of "
                             f"topk_group {self.topk_group} groups")


def grouped_topk(logits: torch.Tensor, top_k: int, routing: GroupRouting,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, experts [T, K] int64) (module docstring)."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)  # [T, E]
    choice = scores + bias.float() if bias is not None else scores  # [T, E]
    if routing.group_score != "none":
        t, e = choice.shape
        grouped = choice.view(t, routing.n_group, e // routing.n_group)  # [T, G, E/G]
        if routing.group_score == "max":
            group = grouped.max(dim=-1).values  # [T, G]
        else:
            group = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = torch.topk(group, routing.topk_group, dim=-1).indices  # [T, topk_group]
        mask = torch.zeros_like(group, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = choice.masked_fill(~mask.repeat_interleave(e // routing.n_group, dim=1), float("-inf"))
    experts = torch.topk(choice, top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, experts)  # [T, K]
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale, experts


class GroupRoutedMoE(MoE):
    """MoE whose experts are chosen by `grouped_topk` (DeepSeek-V2 / V3) from a float32 router; with
    `correction_bias` it holds V3's `e_score_correction_bias` [E] (float32, replicated)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, routing: GroupRouting,
                 act: str = "silu", tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                 device=None, ep_size: int = 1, correction_bias: bool = False) -> None:
        super().__init__(hidden, inter, num_experts, top_k, act, tp_rank, tp_size, dtype, device, routing.renormalize,
                         ep_size)
        routing.check(num_experts, top_k)
        self.routing = routing
        self.router = Linear(hidden, num_experts, parallel=Parallel.REPLICATED, dtype=torch.float32, device=device)
        self.router.keep_float = True  # core.quant.apply skips it: an int8 router flips near-tied choices
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32, device=device), requires_grad=False) if correction_bias \
            else None

    def select(self, x: torch.Tensor, lora=None, triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] float32, experts [T, K]): float32 logits through grouped_topk."""
        logits = self.router(x.float(), lora)  # [T, E]
        return grouped_topk(logits, self.top_k, self.routing, self.e_score_correction_bias)


class SharedExpertsMoE(nn.Module):
    """y = experts(x) + shared_experts(x): routed experts (GroupRoutedMoE) plus always-on shared experts
    (a GatedMLP of n_shared * I, TP-split like any MLP, no sigmoid gate unlike Qwen2-MoE's)."""

    def __init__(self, experts: MoE, shared_experts: GatedMLP | None) -> None:
        super().__init__()
        self.experts = experts
        self.shared_experts = shared_experts  # None: n_shared_experts 0

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] (each part all-reduced over tp ranks)."""
        y = self.experts(x, lora)
        return y if self.shared_experts is None else y + self.shared_experts(x, lora)
