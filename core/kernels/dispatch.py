"""The one entry point layers call for an op: Triton kernel, compiled CPU kernel or torch reference.

Mode, read once from the environment variable BESTIARY_KERNELS (default "auto"):

    auto    Triton for CUDA tensors; on the CPU the compiled C kernels (core.kernels.cpu) for the ops
            they have (float32 / bfloat16 tensors, library built), else the torch reference
    triton  Triton always (CPU tensors then need TRITON_INTERPRET=1: the kernel tests)
    torch   the torch reference always

`set_mode(m)` changes it for the process and `kernels_mode(m)` for a `with` block (tests).
`LoraWeights` is one linear module's adapters in lora_sgmv's layout (core.lora.batch builds them).
Each op costs one mode/device check on top of the implementation it picks; the torch
references are the exact tensor ops the layers ran before dispatch existed.

The family modules (norms, rotary, activations, attention, moe, woq_gemm, lora, sampling)
import triton, and `@triton.jit` reads TRITON_INTERPRET when it decorates a kernel, so a
family is imported on the first call that needs it, never when this module is imported.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from bestiary.core.format.errors import ConfigError

if TYPE_CHECKING:
    from bestiary.core.kernels.metadata import AttentionMetadata

MODES = ("auto", "triton", "torch")
# The Triton family modules (bestiary.core.kernels.<name>); each imports triton, so `family` loads it
# on first use. The rest of core.kernels is triton-free: metadata, attention_window, the *_ref torch
# references, kv_codes, cpu (the compiled CPU kernels).
FAMILIES = ("norms", "rotary", "activations", "attention", "moe", "woq_gemm", "lora", "sampling")
ENV_VAR = "BESTIARY_KERNELS"


def _checked(mode: str, source: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"{source}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


_mode: str = _checked(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)
_families: dict[str, ModuleType] = {}


def mode() -> str:
    """The current dispatch mode: auto, triton or torch."""
    return _mode


def set_mode(new: str) -> None:
    """Set the dispatch mode for the whole process."""
    global _mode
    _mode = _checked(new, "kernels mode")


@contextmanager
def kernels_mode(new: str) -> Iterator[None]:
    """Run a block under dispatch mode `new` (e.g. "triton" to force the kernels in tests)."""
    old = _mode
    set_mode(new)
    try:
        yield
    finally:
        set_mode(old)


def use_triton(x: torch.Tensor) -> bool:
    """True when an op on `x` runs its Triton kernel (the one check per call)."""
    return x.is_cuda if _mode == "auto" else _mode == "triton"


def use_cpu_kernels(*tensors: torch.Tensor) -> bool:
    """True when an op on these CPU tensors runs the compiled kernels of core.kernels.cpu (mode auto)."""
    return _mode == "auto" and tensors[0].device.type == "cpu" and cpu_ops().supports(*tensors)


def _cpu_decode_step(q: torch.Tensor, meta: AttentionMetadata, key_bias) -> bool:
    """A decode step the compiled CPU decode attention can take (its pools' dtypes aside)."""
    return (key_bias is None and meta.is_decode and not use_triton(q)
            and q.shape[-1] <= cpu_ops().MAX_HEAD_DIM and use_cpu_kernels(q))


def reads_kv_codes(q: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, key_bias) -> bool:
    """True when this step's attention runs the compiled CPU decode kernel straight on INT8/FP8 pools."""
    return _cpu_decode_step(q, meta, key_bias) and k_pool.device.type == "cpu" and k_pool.dtype in cpu_ops().KV_CODES


def cpu_ops() -> ModuleType:
    """bestiary.core.kernels.cpu.ops (compiled CPU kernels + their torch references), imported on first use."""
    module = _families.get("cpu")
    if module is None:
        module = _families["cpu"] = importlib.import_module("bestiary.core.kernels.cpu.ops")
    return module


def family(name: str) -> ModuleType:
    """The kernel module `bestiary.core.kernels.<name>`, imported on first use."""
    module = _families.get(name)
    if module is None:
        module = _families[name] = importlib.import_module(f"bestiary.core.kernels.{name}")
    return module


# --- norms ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w over the last dim: x [..., H] -> [..., H]."""
    m = family("norms")
    if use_triton(x):
        return m.rms_norm(x, weight, eps)
    if use_cpu_kernels(x, weight):
        return cpu_ops().rms_norm(x, weight, eps)
    return m.rms_norm_ref(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = (x - mean) / sqrt(var + eps) * w + b over the last dim: x [..., H] -> [..., H]."""
    m = family("norms")
    return m.layer_norm(x, weight, bias, eps) if use_triton(x) else m.layer_norm_ref(x, weight, bias, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (rms_norm(h), h)."""
    m = family("norms")
    if not use_triton(x) and use_cpu_kernels(x, residual, weight):
        return cpu_ops().rms_norm(x, weight, eps, residual)
    fn = m.add_rms_norm if use_triton(x) else m.add_rms_norm_ref
    return fn(x, residual, weight, eps)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (layer_norm(h), h)."""
    m = family("norms")
    fn = m.add_layer_norm if use_triton(x) else m.add_layer_norm_ref
    return fn(x, residual, weight, bias, eps)


# --- rotary --------------------------------------------------------------------------------


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, style: str) -> None:
    """Rotate the first rot_dim dims of x [T, n, D] in place; cos/sin [T, 1, rot_dim/2]."""
    m = family("rotary")
    if use_triton(x):
        m.apply_rotary(x, cos, sin, rot_dim, style)
    elif use_cpu_kernels(x, cos) and cpu_ops().rotary_layout_ok(x, cos, sin):
        cpu_ops().rotary(x, cos, sin, rot_dim, style)
    else:
        m.apply_rotary_ref(x, cos, sin, rot_dim, style)


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rot_dim: int, style: str
) -> None:
    """Rotate x [T, n, D] in place at `positions` [T], from the table cos_sin [P, rot_dim] = [cos | sin]."""
    m = family("rotary")
    fn = m.rotary_embedding if use_triton(x) else m.rotary_embedding_ref
    fn(x, positions, cos_sin, rot_dim, style)


# --- activations ---------------------------------------------------------------------------


def act_and_mul(f: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """y = act(f) * g (the gated MLP's middle): f, g [T, I] -> [T, I]."""
    m = family("activations")
    return m.act_and_mul(f, g, act) if use_triton(f) else m.act_and_mul_ref(f, g, act)


def gated_act(fg: torch.Tensor, act: str) -> torch.Tensor:
    """y = act(f) * g for the fused gate output fg [T, 2I] = [f | g] -> [T, I]."""
    if use_cpu_kernels(fg) and fg.dim() == 2:
        return cpu_ops().act_and_mul(fg, act)
    f, g = fg.chunk(2, dim=-1)
    return act_and_mul(f, g, act)


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """y = act(x) elementwise (the plain MLP's middle)."""
    m = family("activations")
    return m.activation(x, act) if use_triton(x) else m.activation_ref(x, act)


# --- attention -----------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
    kv_scales: torch.Tensor | None = None, window: int = 0, softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this step's queries q [T, H, D] over the (already written) paged cache -> [T, H*D].

    `kv_scales` (s_k, s_v): the pools hold INT8/FP8 codes, only where `reads_kv_codes` said so.
    `window`: the layer's sliding window (0: none), narrowed per sequence by meta.windows / meta.sinks
    (core.kernels.attention_window). `softcap` c: scores capped as c tanh(s / c) before any bias; only
    the torch path computes that (attention_ref.capped_attention, on every device). `sink_logits` [H]:
    one learned logit per query head in the softmax's denominator (gpt-oss; not the StreamingLLM sink
    tokens of meta.sinks), the torch path too: neither the Triton kernels nor the compiled CPU ones have it."""
    m = family("attention")
    bounds = meta.window_bounds(window)  # None: plain causal attention
    if softcap is not None or sink_logits is not None:
        return family("attention_ref").capped_attention(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias,
                                                        bounds, softcap, sink_logits)
    if kv_scales is not None or (_cpu_decode_step(q, meta, key_bias) and use_cpu_kernels(k_pool)):
        kv_lens = meta.step_value("kv_lens", lambda: torch.tensor(meta.kv_lens, dtype=torch.int64))
        return cpu_ops().decode_attention(q, k_pool, v_pool, meta.block_tables, kv_lens, scale, slopes, kv_scales,
                                          bounds)
    fn = m.paged_attention if use_triton(q) else m.paged_attention_ref
    return fn(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias, bounds)


# --- MoE -----------------------------------------------------------------------------------


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, experts [T, K] int64)."""
    m = family("moe")
    fn = m.moe_route if use_triton(logits) else m.moe_route_ref
    return fn(logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor, w_fc: torch.Tensor, w_gate: torch.Tensor | None, w_proj: torch.Tensor,
    weights: torch.Tensor, experts: torch.Tensor, act: str,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]): x [T, H] -> [T, H] (see moe.py for shapes)."""
    m = family("moe")
    fn = m.fused_moe if use_triton(x) else m.fused_moe_ref
    return fn(x, w_fc, w_gate, w_proj, weights, experts, act)


# --- weight-only GEMM ----------------------------------------------------------------------


def woq_int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = (x @ q^T) * s + b, q int8 [N, K] per output channel: x [..., K] -> [..., N]."""
    m = family("woq_gemm")
    fn = m.woq_int8_linear if use_triton(x) else m.woq_int8_linear_ref
    return fn(x, qweight, scales, bias)


def woq_int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ ((q - z) * s)^T + b with packed int4 q (layout in woq_gemm.py): x [..., K] -> [..., N]."""
    m = family("woq_gemm")
    fn = m.woq_int4_linear if use_triton(x) else m.woq_int4_linear_ref
    return fn(x, qweight, scales, zeros, group_size, bias)


# --- LoRA ----------------------------------------------------------------------------------


def lora_sgmv(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
    seg_adapters: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor, max_seg_len: int | None = None,
) -> torch.Tensor:
    """Per-segment LoRA delta [T, N] for packed x [T, K] (shapes in lora.py).

    max_seg_len (the longest segment, known to the caller) spares the kernel path a device sync.
    """
    m = family("lora")
    if use_triton(x):
        return m.lora_sgmv(x, lora_a, lora_b, seg_starts, seg_adapters, ranks, scalings, max_seg_len=max_seg_len)
    return m.lora_sgmv_ref(x, lora_a, lora_b, seg_starts, seg_adapters, ranks, scalings)


@dataclass
class LoraWeights:
    """One linear module's adapters, stacked and zero-padded to the largest rank R (lora.py's layout).

    lora_a [L, R, K], lora_b [L, N, R] in the module's dtype; ranks [L] int32; scalings [L] float (alpha / r).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor


# --- sampling ------------------------------------------------------------------------------


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with everything outside each row's top-k / top-p set to -inf."""
    m = family("sampling")
    return m.filter_logits(logits, top_k, top_p) if use_triton(logits) else m.filter_logits_ref(logits, top_k, top_p)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The greedy token of each row of logits [B, V]: torch.argmax (first maximum; NaN counts as the
    maximum), the compiled kernel on CPU float32 rows (~6x torch's on a 49k vocabulary)."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and use_cpu_kernels(logits):
        return cpu_ops().argmax_rows(logits).tolist()
    return logits.argmax(dim=-1).tolist()
