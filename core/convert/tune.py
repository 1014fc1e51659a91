"""End-to-end tuning of int4 group scales by distillation from the float model (codes fixed).

GPTQ (core.quant.gptq) fixes each quantized linear's codes q layer by layer, each against its
own output error. What the user measures is the model's next-token distribution, so the
group scales s (and zero points z) are then trained, all layers at once, to bring the quantized
model's distributions close to the float model's over the calibration tokens:

    W(u, z)[n, k] = (q[n, k] - z[n, g]) * s0[n, g] * exp(u[n, g]),    g = k // G
    loss          = mean_t KL(p_t || p~_t)

p_t is the float model's next-token distribution at calibration token t, kept as its top
TOP_K probabilities and the rest's total mass (KL over those K + 1 outcomes; the tail the float
model itself gives little mass is not tracked token by token), and p~_t the quantized model's.
u starts at 0 (GPTQ's scales) and z at GPTQ's zero points (symmetric layers keep z = 8); Adam
takes `steps` steps of LR, one calibration sequence per step, cycling through the sequences.
The codes do not change, so the checkpoint layout is GPTQ's; zero points become non-integers,
which every int4 kernel takes (w = (q - z) s; packing.int4_cpu_scale_zeros).

This is EfficientQAT's end-to-end step (Chen et al., 2024: train the quantization parameters
with the integer weights frozen), with the float model as teacher. Measured on SmolLM2-135M
W4A16 g128 with zero points (lm_head float) and the built-in calibration text (38 sequences):
+12.2% perplexity after GPTQ, +7.7% after the default 40 steps; 76 steps gave +8.0%, and tuning
the norm weights too or training the codes (straight-through) did worse (docs/quantization.md).
The model runs in torch mode (kernels_mode("torch")), where every op has a gradient; one step
costs a forward and a backward of one calibration sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from bestiary.core.format import packing
from bestiary.core.format.packing import Int4Codes
from bestiary.core.runtime.model import DecoderLM

TOP_K = 128
DEFAULT_STEPS = 40
LR = 1e-3


@dataclass
class TeacherTargets:
    """The float model's next-token distribution at every token of one sequence, top TOP_K kept."""

    ids: torch.Tensor  # int64 [T, K]
    log_p: torch.Tensor  # float32 [T, K]
    log_rest: torch.Tensor  # float32 [T]: log of the mass outside the top K

    @classmethod
    def from_logits(cls, logits: torch.Tensor, top_k: int = TOP_K) -> TeacherTargets:
        log_p = torch.log_softmax(logits.detach().float(), dim=-1)  # [T, V]
        top, ids = log_p.topk(min(top_k, log_p.shape[-1]), dim=-1)  # [T, K]
        return cls(ids, top, _log_rest(top))

    def usable_in_autograd(self) -> TeacherTargets:
        """A copy made outside inference mode (targets recorded under torch.inference_mode cannot
        enter a graph)."""
        return TeacherTargets(self.ids.clone(), self.log_p.clone(), self.log_rest.clone())


def _log_rest(top_log_p: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k exp(top_log_p[..., k])), clamped away from log 0."""
    return torch.log1p(-top_log_p.exp().sum(dim=-1).clamp(max=1.0 - 1e-6))


def distillation_loss(logits: torch.Tensor, target: TeacherTargets) -> torch.Tensor:
    """Mean over tokens of KL(p || p~) over the teacher's top K and the rest (module docstring); logits [T, V]."""
    log_q = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    top_q = log_q.gather(-1, target.ids)  # [T, K]
    p = target.log_p.exp()
    kl_top = (p * (target.log_p - top_q)).sum(dim=-1)  # [T]
    kl_rest = target.log_rest.exp() * (target.log_rest - _log_rest(top_q))  # [T]
    return (kl_top + kl_rest).mean()


class _GroupDequant(torch.autograd.Function):
    """w [N, groups, G] = (q - z[..., None]) * s[..., None] with its backward written per group:

        dL/ds[n, g] = sum_j dw[n, g, j] (q[n, g, j] - z[n, g]) = sum_j dw q - z sum_j dw
        dL/dz[n, g] = -s[n, g] sum_j dw[n, g, j]

    two reductions of dw [N, groups, G] and one product, where autograd's graph of the broadcast keeps a
    (q - z) copy and reduces through broadcast and negation backwards (a step of SmolLM2-135M W4A16 g128 on
    one thread: 10.4 -> 10.0 s; the rest is the model's own GEMMs)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, s, z)  # q [N, groups, G]; s, z [N, groups]
        return (q - z[..., None]).mul_(s[..., None])

    @staticmethod
    def backward(ctx, dw: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor | None]:
        q, s, z = ctx.saved_tensors
        dw_sum = dw.sum(dim=-1)  # [N, groups]
        ds = (dw * q).sum(dim=-1).sub_(z * dw_sum)  # [N, groups]
        dz = -s * dw_sum if ctx.needs_input_grad[2] else None
        return None, ds, dz


class GroupScaled(nn.Module):
    """Parametrization of a Linear's weight: (q - z) * s0 * exp(u), trainable u (and z with zero points)."""

    q: torch.Tensor  # uint8 [N, K] codes (buffers: torch's Module.__getattr__ does not type them)
    q_grouped: torch.Tensor  # float32 [N, groups, G]
    s0: torch.Tensor  # float32 [N, groups]: GPTQ's scales
    z: nn.Parameter | None  # float32 [N, groups] zero points (None: symmetric, z = 8)

    def __init__(self, layer: Int4Codes, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size, self.dtype = layer.group_size, dtype
        n, k = layer.codes.shape
        groups = packing.num_groups(k, layer.group_size)
        self.k = k
        self.register_buffer("q", layer.codes, persistent=False)  # uint8 [N, K]
        # the codes widened once, by group (a short last group padded): [N, groups, G] float32, so a step's
        # weight is one broadcast (q - z) * s with no per-step widening or [N, K] copies of s and z
        widened = torch.nn.functional.pad(layer.codes.float(), (0, groups * layer.group_size - k))
        self.register_buffer("q_grouped", widened.view(n, groups, layer.group_size), persistent=False)
        self.register_buffer("s0", layer.s.float(), persistent=False)  # [N, groups]
        self.u = nn.Parameter(torch.zeros_like(self.s0))
        self.z = None if layer.z is None else nn.Parameter(layer.z.float().clone())

    def scales(self) -> torch.Tensor:
        """s [N, groups] = s0 * exp(u)."""
        return self.s0 * self.u.exp()

    def forward(self, _weight: torch.Tensor) -> torch.Tensor:
        """[N, K] = (q - z[k // G]) * s[k // G], packing.dequantize_int4's formula with the current scales
        (differentiable in u, z), computed per group (_GroupDequant)."""
        z = self.z if self.z is not None else torch.full_like(self.s0, 8.0)  # [N, groups]
        w = _GroupDequant.apply(self.q_grouped, self.scales(), z).flatten(1)  # [N, groups * G]
        if w.shape[1] != self.k:  # a short last group: its padding dropped
            w = w[:, : self.k]
        return w.to(self.dtype)

    def tuned(self) -> Int4Codes:
        z = None if self.z is None else self.z.detach().clone()
        return Int4Codes(self.q, self.scales().detach(), z, self.group_size)


def tune_group_scales(
    model: DecoderLM,
    layers: dict[str, Int4Codes],
    chunks: list[list[int]],
    targets: list[TeacherTargets],
    steps: int = DEFAULT_STEPS,
    lr: float = LR,
    on_step: Callable[[float], None] | None = None,
) -> dict[str, Int4Codes]:
    """Tune the scales of `layers` (linear name -> GPTQ's codes) in the float `model` to distil `targets`
    (one per calibration sequence of `chunks`); returns linear name -> tuned codes and scales.

    `model` is the float model whose quantized linears are named in `layers` (its weights are
    replaced by the parametrization while tuning, and left as the tuned dequantized weights);
    `on_step(loss)` is called after each step (progress)."""
    from bestiary.core.convert.calibration import chunk_logits
    from bestiary.core.kernels.dispatch import kernels_mode
    from bestiary.core.layers.linear import Linear

    if len(chunks) != len(targets):
        raise ValueError(f"{len(chunks)} calibration sequences but {len(targets)} teacher targets")
    linears = {m.name or p: m for p, m in model.named_modules() if isinstance(m, Linear)}
    missing = sorted(set(layers) - set(linears))
    if missing:
        raise ValueError(f"tune_group_scales: no Linear {missing[0]!r} in the model")
    targets = [t.usable_in_autograd() for t in targets]
    model.requires_grad_(False)
    params: dict[str, GroupScaled] = {}
    for name, layer in layers.items():
        linear = linears[name]
        params[name] = GroupScaled(layer, linear.weight.dtype)
        parametrize.register_parametrization(linear, "weight", params[name], unsafe=True)
    opt = torch.optim.Adam([p for m in params.values() for p in m.parameters()], lr=lr)
    try:
        with kernels_mode("torch"), torch.enable_grad():
            for step in range(steps):
                i = step % len(chunks)
                loss = distillation_loss(chunk_logits(model, chunks[i]), targets[i])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if on_step is not None:
                    on_step(float(loss.detach()))
    finally:
        with torch.no_grad():
            tuned = {name: m.tuned() for name, m in params.items()}
            for name in params:
                parametrize.remove_parametrizations(linears[name], "weight", leave_parametrized=True)
    return tuned
