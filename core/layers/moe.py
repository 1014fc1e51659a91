"""Sparse mixture of experts (Mixtral-style): a top-k router over n gated (SwiGLU) experts.

For a token x [H], with router logits l = W_r x [E] and K = top_k:

    S       = the K experts with the largest l_e
    w_e     = exp(l_e) / sum_{j in S} exp(l_j)          (softmax over the top-k logits)
    expert_e(x) = proj_e(act(fc_e x) * (gate_e x))
    y       = sum_{e in S} w_e expert_e(x)

w_e equals HF Mixtral's softmax over all E logits, top-k, renormalised over the k kept. Without
renormalisation (Qwen2-MoE's norm_topk_prob false) w_e = exp(l_e) / sum_j exp(l_j), over all E.

`SharedExpertMoE` adds an always-on expert with a sigmoid gate (Qwen2-MoE):

    y = MoE(x) + sigmoid(w_s . x) * shared_expert(x)      w_s: `shared_expert_gate` [1, H]

Checkpoint names (module `mlp`): `mlp.router.weight` [E, H] (replicated), and the experts
stacked on a leading dim: `mlp.fc.weight` [E, I, H] (gate_proj / w1), `mlp.gate.weight`
[E, I, H] (up_proj / w3), `mlp.proj.weight` [E, H, I] (down_proj / w2).

Tensor parallelism splits every expert along its FFN dim I (fc/gate tp_dim 1, proj tp_dim
2): each rank computes a partial y over its I/tp slice of every expert, and one
all-reduce sums them (the routing weights are linear, so they apply before the reduce).

Expert parallelism (mapping moe_ep_size > 1, TensorRT-LLM's fields): the tp ranks hold
moe_ep_size groups of E / moe_ep_size whole experts, ep_rank = tp_rank % moe_ep_size holding experts
[ep_rank E/ep, (ep_rank + 1) E/ep), each split along I over moe_tp_size = tp / ep ranks
(moe_tp_rank = tp_rank // moe_ep_size). Every rank routes every token with the whole (replicated)
router and runs only its local experts (global id e -> local e - ep_rank E/ep); a rank's partial

    y_r = sum_{e in S, e local to r} w_e expert_e(x)|_{its I slice}

sums over the tp ranks to y, so the combine is the same single all-reduce as plain TP. Not an
all-to-all: with TP attention every rank already holds every token's hidden state, so nothing has
to be dispatched, and a sum over ranks is exactly one all-reduce; all-to-all dispatch/combine pays
off when tokens are partitioned across ranks (data-parallel attention), which bestiary does not do.

The forward is the torch reference: a loop over the experts that received tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.activations_ref import activation
from bestiary.core.kernels.metadata import LoraDelta
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.mlp import GatedMLP


class ExpertLinear(nn.Module):
    """E stacked bias-free linear maps: weight [E_local, out_local, in_local]; y = x W_e^T for local expert e.

    Column-parallel splits out_features (tp_dim 1), row-parallel in_features (tp_dim 2), over
    (tp_rank, tp_size): the mapping's moe_tp rank and size. With ep_size > 1 the rank holds only
    experts first_expert .. first_expert + E / ep_size - 1 (E_local = E / ep_size).
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        parallel: Parallel,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device=None,
        ep_rank: int = 0,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        self.parallel = Parallel(parallel)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if num_experts % ep_size:
            raise ValueError(f"num_local_experts {num_experts} is not divisible by moe_ep_size {ep_size}")
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.num_local = num_experts // ep_size  # experts this rank holds
        self.first_expert = ep_rank * self.num_local  # global id of local expert 0
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        split = out_features if self.parallel == Parallel.COLUMN else in_features
        if self.parallel != Parallel.REPLICATED and split % tp_size:
            raise ValueError(f"expert intermediate_size {split} is not divisible by tp_size {tp_size}")
        out_local = out_features // tp_size if self.parallel == Parallel.COLUMN else out_features
        in_local = in_features // tp_size if self.parallel == Parallel.ROW else in_features
        self.weight = nn.Parameter(
            torch.empty(self.num_local, out_local, in_local, dtype=dtype, device=device), requires_grad=False
        )
        self.name = ""  # canonical module path, set by the model (LoRA selects experts by it)

    def tp_dim(self, param_name: str) -> int:
        """Slicing dim of `weight` [E, out, in]: 1 (column), 2 (row), -1 (replicated)."""
        return {Parallel.COLUMN: 1, Parallel.ROW: 2}.get(self.parallel, -1)

    def shard(self, param_name: str) -> dict:
        """The loader's Target overrides under expert parallelism (core.convert.loader): tp_split, the
        (parts, part) of tp_dim (moe_tp, not the mapping's tp), and experts, (ep_size, ep_rank) of dim 0."""
        if self.ep_size == 1:
            return {}
        return {"tp_split": (self.tp_size, self.tp_rank), "experts": (self.ep_size, self.ep_rank)}

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [N, in_local] -> [N, out_local] through local expert `expert` (row-parallel: partial sum)."""
        return F.linear(x, self.weight[expert])

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, "
            f"parallel={self.parallel.value}, tp={self.tp_rank}/{self.tp_size}"
            + (f", ep={self.ep_rank}/{self.ep_size} (experts {self.first_expert}.."
               f"{self.first_expert + self.num_local - 1})" if self.ep_size > 1 else "")
        )


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, experts [T, K] int64).

    weights = softmax over the K largest logits of each token (computed in float32), or with
    `renormalize` false the softmax over all E logits at the K largest.
    """
    if not renormalize:
        return torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    top, experts = torch.topk(logits.float(), top_k, dim=-1)  # [T, K]
    return torch.softmax(top, dim=-1), experts


class MoE(nn.Module):
    """x [T, H] -> sum over the top-k experts of w_e * proj_e(act(fc_e x) * gate_e x).

    Submodules match the checkpoint: `router` (Linear, replicated), `fc`, `gate`, `proj`
    (ExpertLinear). After loading, `fuse()` packs fc and gate into one [E, 2 I_local, H].
    The partial outputs are all-reduced on `tp_group` (None: the default world; see Linear).
    `ep_size` (the mapping's moe_ep_size) spreads the experts over the tp ranks (module docstring):
    moe_tp_size = tp_size / ep_size, moe_tp_rank = tp_rank // ep_size, ep_rank = tp_rank % ep_size.
    """

    tp_group = None

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        act: str = "silu",
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device=None,
        renormalize: bool = True,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_local_experts ({num_experts})")
        if tp_size % ep_size:
            raise ValueError(f"moe_ep_size {ep_size} does not divide tp_size {tp_size}")
        self.num_experts, self.top_k, self.tp_size, self.ep_size = num_experts, top_k, tp_size, ep_size
        self.renormalize = renormalize  # the top-k weights sum to 1 (else: softmax over all experts)
        tp = dict(tp_rank=tp_rank // ep_size, tp_size=tp_size // ep_size, dtype=dtype, device=device,
                  ep_rank=tp_rank % ep_size, ep_size=ep_size)  # the experts' moe_tp and ep placement
        self.router = Linear(hidden, num_experts, parallel=Parallel.REPLICATED, dtype=dtype, device=device)
        self.fc = ExpertLinear(num_experts, hidden, inter, Parallel.COLUMN, **tp)
        self.gate = ExpertLinear(num_experts, hidden, inter, Parallel.COLUMN, **tp)
        self.proj = ExpertLinear(num_experts, inter, hidden, Parallel.ROW, **tp)
        self.act = activation(act)
        self.act_name = act
        self._fused: torch.Tensor | None = None  # [E, 2 I_local, H] once fused

    def fuse(self) -> None:
        """Pack fc and gate into one [E, 2 I_local, H] tensor; fc/gate become views of it."""
        inter = self.fc.weight.shape[1]
        self._fused = torch.cat([self.fc.weight, self.gate.weight], dim=1)
        self.fc.weight.data, self.gate.weight.data = self._fused[:, :inter], self._fused[:, inter:]

    def expert(self, x: torch.Tensor, e: int, lora=None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e on its tokens: x [N, H] -> partial proj_e(act(fc_e x) * gate_e x) [N, H].

        With `lora` (a core.lora.batch.StepLora), `tokens` [N] are x's rows in the packed batch and
        each expert linear gets its adapters' delta (LoRA modules moe_h_to_4h, moe_gate, moe_4h_to_h)."""
        if self._fused is not None:
            fg = F.linear(x, self._fused[e])  # [N, 2 I_local]
        else:
            fg = torch.cat([self.fc(x, e), self.gate(x, e)], dim=-1)
        if lora is not None:  # adapters are keyed by global expert ids
            delta = lora.expert((self.fc, self.gate), self.fc.first_expert + e, x, tokens)
            if delta is not None:
                fg = fg + delta
        f, g = fg.chunk(2, dim=-1)  # [N, I_local] each
        h = self.act(f) * g
        y = self.proj(h, e)
        if lora is not None:
            delta = lora.expert((self.proj,), self.fc.first_expert + e, h, tokens)
            if delta is not None:
                y = y + delta
        return y

    def partial_forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [T, H] -> this rank's partial output [T, H] (its I slice of each of its local experts)."""
        if dispatch.use_triton(x) and lora is None:  # routing + grouped expert GEMMs in kernels.moe
            weights, experts = dispatch.moe_route(self.router(x), self.top_k, self.renormalize)
            if self.ep_size > 1:
                return self._fused_local(x, weights, experts)
            return dispatch.fused_moe(x, self.fc.weight, self.gate.weight, self.proj.weight, weights, experts,
                                      self.act_name)
        weights, experts = route(self.router(x, lora), self.top_k, self.renormalize)  # [T, K], [T, K]
        local = experts - self.fc.first_expert  # [T, K] local ids; outside 0..E_local-1: another rank's
        out = torch.zeros_like(x)  # [T, H]
        for e in local.unique().tolist():
            if not 0 <= e < self.fc.num_local:
                continue
            tokens, slots = torch.where(local == e)  # [N], [N]
            y = self.expert(x.index_select(0, tokens), e, lora, tokens)  # [N, H]
            out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(out.dtype))
        return out

    def _fused_local(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism on the Triton path: only the (token, slot) pairs routed to a local expert,
        as N top-1 rows (local ids), through the grouped GEMMs; x [T, H] -> partial [T, H]."""
        local = experts - self.fc.first_expert  # [T, K]
        tokens, slots = torch.where((local >= 0) & (local < self.fc.num_local))  # [N], [N]
        out = torch.zeros_like(x)  # [T, H]
        if tokens.numel():
            y = dispatch.fused_moe(x.index_select(0, tokens), self.fc.weight, self.gate.weight, self.proj.weight,
                                   weights[tokens, slots, None], local[tokens, slots, None], self.act_name)  # [N, H]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H], all-reduced over tp ranks; `lora` adapts the router and the experts."""
        out = self.partial_forward(x, lora)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out


class SharedExpertMoE(MoE):
    """MoE + an always-on gated expert: y = MoE(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x).

    Submodules: MoE's, plus `shared_expert` (a GatedMLP of its own FFN width, TP-split like any
    MLP over all tp_size ranks, expert parallelism or not) and `shared_expert_gate` (Linear [1, H],
    replicated). The router and the shared-expert gate stay float under weight quantization
    (`keep_float`, as vLLM's Qwen2-MoE builds them with quant_config=None): an int8 router flips
    near-tied top-k choices and moves logits by ~25%."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, shared_inter: int, act: str = "silu",
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.float32, device=None,
                 renormalize: bool = True, ep_size: int = 1) -> None:
        super().__init__(hidden, inter, num_experts, top_k, act, tp_rank, tp_size, dtype, device, renormalize,
                         ep_size)
        self.shared_expert = GatedMLP(hidden, shared_inter, act, False, tp_rank=tp_rank, tp_size=tp_size,
                                      dtype=dtype, device=device)
        self.shared_expert_gate = Linear(hidden, 1, parallel=Parallel.REPLICATED, dtype=dtype, device=device)
        self.router.keep_float = self.shared_expert_gate.keep_float = True  # core.quant.apply skips them

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] (each part all-reduced over tp ranks)."""
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora)  # [T, 1] * [T, H]
        return super().forward(x, lora) + shared


def stack_experts(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Postprocess: E per-expert matrices [out, in] (the key map's fan-out order) -> [E, out, in].

    A single source that is already stacked ([E, out, in]) passes through unchanged.
    """
    if len(tensors) == 1 and tensors[0].dim() == 3:
        return {key: tensors[0]}
    if any(t.dim() != 2 for t in tensors):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"{key}: expected per-expert 2-D matrices, got shapes {shapes}")
    return {key: torch.stack(tensors)}
