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

gpt-oss's experts (`glu=ClampedSwiGLU(alpha, limit)`, `expert_bias=True`): each expert linear has a
bias and the activation is its clamped SwiGLU,

    g = min(fc_e x + b, L),  u = clamp(gate_e x + b', -L, L),  h = (u + 1) * g * sigmoid(alpha g)

These run the reference loop on every device: the fused kernels (core.kernels.moe.fused_moe, Triton)
have neither biases nor this activation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.activations_ref import activation
from bestiary.core.kernels.metadata import LoraDelta
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.mlp import GatedMLP


class ExpertLinear(nn.Module):
    """E stacked linear maps: weight [E_local, out_local, in_local]; y = x W_e^T (+ b_e) for local expert e.

    Column-parallel splits out_features (tp_dim 1), row-parallel in_features (tp_dim 2), over
    (tp_rank, tp_size): the mapping's moe_tp rank and size. With ep_size > 1 the rank holds only
    experts first_expert .. first_expert + E / ep_size - 1 (E_local = E / ep_size).
    With `bias` (gpt-oss): bias [E_local, out_local], cut with the out dim (column-parallel); a
    row-parallel bias [E_local, out] is whole on every rank and added by moe_tp rank 0 only, so the
    all-reduce of the partial outputs counts it once (and, under EP, the rank group holding the expert
    adds it, weighted by the routing weight as the rest of the expert's output).
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
        bias: bool = False,
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
        self.bias = nn.Parameter(torch.empty(self.num_local, out_local, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None  # [E_local, out_local]
        self.name = ""  # canonical module path, set by the model (LoRA selects experts by it)

    def tp_dim(self, param_name: str) -> int:
        """Slicing dim of `weight` [E, out, in]: 1 (column), 2 (row), -1 (replicated); of `bias` [E, out]:
        1 (column), else -1 (whole)."""
        if param_name == "bias":
            return 1 if self.parallel == Parallel.COLUMN else -1
        return {Parallel.COLUMN: 1, Parallel.ROW: 2}.get(self.parallel, -1)

    def shard(self, param_name: str) -> dict:
        """The loader's Target overrides under expert parallelism (core.convert.loader): tp_split, the
        (parts, part) of tp_dim (moe_tp, not the mapping's tp), and experts, (ep_size, ep_rank) of dim 0."""
        if self.ep_size == 1:
            return {}
        return {"tp_split": (self.tp_size, self.tp_rank), "experts": (self.ep_size, self.ep_rank)}

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [N, in_local] -> [N, out_local] through local expert `expert` (row-parallel: partial sum, the
        bias on moe_tp rank 0 only)."""
        return F.linear(x, self.weight[expert], self.local_bias(expert))

    def local_bias(self, expert: int) -> torch.Tensor | None:
        """The bias this rank adds for local expert `expert` [out_local], or None (none, or row-parallel
        on moe_tp rank > 0: rank 0 adds it once)."""
        if self.bias is None or (self.parallel == Parallel.ROW and self.tp_rank > 0):
            return None
        return self.bias[expert]

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


class ClampedSwiGLU:
    """gpt-oss's expert activation: h = (clamp(u, -L, L) + 1) * g' sigmoid(alpha g'), g' = min(g, L)
    (g = fc x, u = gate x; transformers' GptOssExperts._apply_gate: alpha swiglu_alpha, L swiglu_limit)."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """g, u [N, I_local] -> h [N, I_local]."""
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"


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
        glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        expert_bias: bool = False,
    ) -> None:
        """glu: the expert's (fc x, gate x) -> h in place of act(fc x) * gate x (ClampedSwiGLU); expert_bias:
        fc, gate and proj with biases (ExpertLinear)."""
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
        self.fc = ExpertLinear(num_experts, hidden, inter, Parallel.COLUMN, **tp, bias=expert_bias)
        self.gate = ExpertLinear(num_experts, hidden, inter, Parallel.COLUMN, **tp, bias=expert_bias)
        self.proj = ExpertLinear(num_experts, inter, hidden, Parallel.ROW, **tp, bias=expert_bias)
        self.act = activation(act)
        self.act_name = act
        self.glu = glu  # (f, g) -> h, or None: act(f) * g
        self._fused: torch.Tensor | None = None  # [E, 2 I_local, H] once fused
        self._fused_bias: torch.Tensor | None = None  # [E, 2 I_local] once fused, with expert biases

    @property
    def kernels_fit(self) -> bool:
        """Whether the fused expert kernels (core.kernels.moe) compute this block: no expert biases, act(f) * g."""
        return self.glu is None and self.fc.bias is None and self.proj.bias is None

    def fuse(self) -> None:
        """Pack fc and gate into one [E, 2 I_local, H] tensor; fc/gate become views of it."""
        inter = self.fc.weight.shape[1]
        self._fused = torch.cat([self.fc.weight, self.gate.weight], dim=1)
        self.fc.weight.data, self.gate.weight.data = self._fused[:, :inter], self._fused[:, inter:]
        if self.fc.bias is not None and self.gate.bias is not None:
            self._fused_bias = torch.cat([self.fc.bias, self.gate.bias], dim=1)  # [E, 2 I_local]
            self.fc.bias.data, self.gate.bias.data = self._fused_bias[:, :inter], self._fused_bias[:, inter:]

    def expert(self, x: torch.Tensor, e: int, lora=None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e on its tokens: x [N, H] -> partial proj_e(act(fc_e x) * gate_e x) [N, H].

        With `lora` (a core.lora.batch.StepLora), `tokens` [N] are x's rows in the packed batch and
        each expert linear gets its adapters' delta (LoRA modules moe_h_to_4h, moe_gate, moe_4h_to_h)."""
        if self._fused is not None:
            bias = None if self._fused_bias is None else self._fused_bias[e]  # [2 I_local]
            fg = F.linear(x, self._fused[e], bias)  # [N, 2 I_local]
        else:
            fg = torch.cat([self.fc(x, e), self.gate(x, e)], dim=-1)
        if lora is not None:  # adapters are keyed by global expert ids
            delta = lora.expert((self.fc, self.gate), self.fc.first_expert + e, x, tokens)
            if delta is not None:
                fg = fg + delta
        f, g = fg.chunk(2, dim=-1)  # [N, I_local] each
        h = self.act(f) * g if self.glu is None else self.glu(f, g)
        y = self.proj(h, e)
        if lora is not None:
            delta = lora.expert((self.proj,), self.fc.first_expert + e, h, tokens)
            if delta is not None:
                y = y + delta
        return y

    def select(self, x: torch.Tensor, lora=None, triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] float32, experts [T, K] int64 global ids): the router's logits through
        `route` (kernels.moe's on the Triton path). A routing of another kind overrides this
        (core.layers.moe_routing: DeepSeek's grouped top-k)."""
        if triton:
            return dispatch.moe_route(self.router(x), self.top_k, self.renormalize)
        return route(self.router(x, lora), self.top_k, self.renormalize)

    def partial_forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [T, H] -> this rank's partial output [T, H] (its I slice of each of its local experts)."""
        if dispatch.use_triton(x) and lora is None and self.kernels_fit:  # routing + grouped GEMMs in kernels.moe
            weights, experts = self.select(x, None, triton=True)
            if self.ep_size > 1:
                return self._fused_local(x, weights, experts)
            return dispatch.fused_moe(x, self.fc.weight, self.gate.weight, self.proj.weight, weights, experts,
                                      self.act_name)
        weights, experts = self.select(x, lora)  # [T, K], [T, K]
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
