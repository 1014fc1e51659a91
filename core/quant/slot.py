"""The quantized-weight slot of a `Linear`: packed weight + scales in the same layer class.

`WeightOnlySlot.install(linear, lq)` swaps the layer's float `weight` for the packed one
and adds `weights_scaling_factor` (and `zeros`) parameters, so the checkpoint names and
`load_state_dict` work unchanged (layouts in core.format.packing).

After loading, `prepare(linear)` repacks for the device that will run it:

    CPU with the compiled kernels (core.kernels.cpu): the checkpoint layout as it is, scales as
                float32 (a core.kernels.cpu.ops.PackedWeight); an int8 weight with N % 8 == 0 and
                K % 16 == 0 is repacked in place into row tiles (packing.pack_int8_tiled: one
                sequential stream per tile); on the avx512bf16 build an int4 weight with
                K % 64 == 0 of a bfloat16 layer into the dot layout its vdpbf16ps GEMV reads
                (packing.pack_int4_dot); a W4A8 int4 weight, and on the avx2 build any int4 weight with
                K % 8 == 0, in place into quads (packing.pack_int4_quads: 8 features of 8 rows a load, one
                sequential stream per tile). All go back to the checkpoint layout on a move to another
                device, or (dot, quads) when prepared again under a build without that GEMV
    CPU, int8:  weight stays int8 [N, K] (aten._weight_int8pack_mm's layout), scales cast
                to the compute dtype
    CPU, int4:  weight repacked in place by aten._convert_weight_to_int4pack_for_cpu (same
                [N, K/2] uint8 shape, its own byte order), plus its [K/G, N, 2] (scale, offset) table
    CUDA:       the checkpoint layout is what core.kernels.woq_gemm's Triton kernels read

y = x W^T + b on the CPU: a step of at most `kernel_max_tokens()` tokens (decode, short prompts) runs
the compiled weight-only GEMV (float32 sums, output in x's dtype), or without it
the aten weight-only kernel on x cast to the compute dtype (bfloat16, the "A16" of
W8A16/W4A16); a longer step (prefill, big batches) dequantizes W and runs one dense matmul,
which is faster there (AMX). With `quantization.activation_quant` set, x is first replaced by
its dynamic uint8 reading (core.quant.online_act: what FastLLM's int8 / int4 matmuls multiply).
activation_quant "int8" (W8A8 dynamic with int8 weights, W4A8 with int4 ones) runs every step, prefill
included, on the compiled int8-activation kernels (x quantized per token row and 64 features): int8 x int8
(linear_a8.c, vpdpbusd) where the int8 weight fits the row tiles, int4 x int8 (linear_w4a8.c, vpmaddubsw) on
the int4 quads where K % 32 == 0; elsewhere x is replaced by its int8 reading
(online_act.int8_per_token) and multiplied in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.format import packing
from bestiary.core.format.packing import Int4Codes
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.cpu.build import cpu_flags, isa_name, library
from bestiary.core.layers import cpu_matmul
from bestiary.core.layers.linear import Linear
from bestiary.core.quant import online_act
from bestiary.core.quant.input_stats import LinearInputStats
from bestiary.core.quant.modes import LinearQuant, check_linear

if TYPE_CHECKING:
    from bestiary.core.kernels.cpu.ops import PackedWeight

# Steps with more tokens than this dequantize to bf16 and run a dense matmul on the CPU
# (the weight-only kernels do not scale with the batch; see docs/quantization.md): the aten
# kernels, and the compiled ones where torch's bf16 GEMM runs on AMX.
DEFAULT_MAX_KERNEL_TOKENS = 8
# the same bound for the compiled kernels, by their build and the weight's bits. torch / kernel time,
# bf16 inputs, over 16 weights of each SmolLM2 shape in turn, 2 threads, one AVX-512 BF16 machine
# without AMX with each build forced (torch's side in float32 on the builds without native bf16;
# `python benchmarks/tiled_crossover.py --quant [--no-native]`):
#   avx512bf16  int8 1.04-1.38 at 24 rows, 0.87-1.17 at 32;  int4 1.05-1.20 at 16, 0.81-0.92 at 24
#   avx512      int8 1.21-1.37 at 128;                       int4 1.06-1.41 at 32, 0.82-1.04 at 64
#   avx2        int8 1.04-1.24 at 128;                       int4 1.00-1.11 at 16, 0.74-0.79 at 24
# avx2 int4 since its GEMV reads the quads (KIND_I4Q), on an AVX2-only Zen 3 (`--quant --no-native`), bfloat16
# inputs in 16-bit integers: 4.1-5.2 at 16, 1.4-2.5 at 64, 1.0-2.0 at 128, 0.9-1.4 at 192, 0.9-1.5 at 256;
# float32 inputs (the float path, QUADS_FLOAT_MAX_TOKENS): 1.2-1.5 at 32, 1.0-1.1 at 48, 0.7-1.0 at 128
COMPILED_MAX_TOKENS = {"avx512bf16": {8: 24, 4: 16}, "avx512": {8: 128, 4: 32}, "avx2": {8: 128, 4: 128}}
QUADS_FLOAT_MAX_TOKENS = 48
SCALE_NAMES = ("weights_scaling_factor", "zeros", "in_perm")
# W4A16_GPTQ layers hold `in_perm` int32 [K_local]: the layer computes x[..., in_perm] W^T, so
# act-order (GPTQ desc_act) weights are stored with group-contiguous in-features
# (core.convert.import_prequantized). Indices count the layer's full in-features; identity when trivial.
PERMUTED_ALGOS = ("W4A16_GPTQ",)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def install_int_weight(linear: Linear, bits: int, group_size: int) -> None:
    """Give `linear` (weight [N, K]) empty packed-integer parameters in the checkpoint layout
    (core.format.packing): bits 8 -> weight int8 [N, K], weights_scaling_factor [N]; bits 4 ->
    weight uint8 [N, K/2], weights_scaling_factor [N, ceil(K / group_size)]. Scales keep the
    layer's dtype."""
    n, k = linear.weight.shape
    dtype, device = linear.weight.dtype, linear.weight.device
    if bits == 8:
        linear.weight = _param(torch.empty(n, k, dtype=torch.int8, device=device))
        linear.weights_scaling_factor = _param(torch.empty(n, dtype=dtype, device=device))
    else:
        groups = packing.num_groups(k, group_size)
        linear.weight = _param(torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        linear.weights_scaling_factor = _param(torch.empty(n, groups, dtype=dtype, device=device))


class WeightOnlySlot:
    """int8 per-channel or int4 group-wise weights of one Linear, and how to multiply by them."""

    def __init__(self, lq: LinearQuant, shape: tuple[int, int]) -> None:
        self.lq = lq
        self.out_local, self.in_local = shape
        self.compute_dtype = torch.bfloat16
        self.max_kernel_tokens: int | None = None  # None: kernel_max_tokens() picks the bound
        self._kernel_bound = DEFAULT_MAX_KERNEL_TOKENS  # prepare(): the bound of the path the layer runs
        self.layout = "checkpoint"  # "cpu" / "dot" / "quads" / "tiled": aten int4, int4 dot, int4 quads, int8 tiles
        self.k_pad = 0  # cpu layout: zero input features appended so the group size divides K
        self._kernel_scales: torch.Tensor | None = None  # int8: [N]; int4 (cpu layout): [K/G, N, 2]
        self.in_offset = 0  # in_perm: first in-feature of this rank (row-parallel on tp ranks)
        self._perm: torch.Tensor | None = None  # the local in_perm on _perm_device; None: identity
        self._perm_device: torch.device | None = None  # None: not looked at yet
        self._packed: PackedWeight | None = None  # when the compiled CPU kernels run this layer

    # --- building the layer ------------------------------------------------------------------
    @classmethod
    def install(cls, linear: Linear, lq: LinearQuant) -> WeightOnlySlot:
        """Replace linear.weight by the packed weight, add the scale (and zero point) parameters."""
        n, k = linear.weight.shape
        check_linear(linear.name, k, n, lq, split_in=linear.parallel == "row" and linear.tp_size > 1)
        device = linear.weight.device
        install_int_weight(linear, lq.bits, lq.group_size)
        if lq.has_zero_point:  # int4: [N, groups]; int8: [N] (imported asymmetric int8, FastLLM .flm)
            linear.zeros = _param(torch.empty_like(linear.weights_scaling_factor))
        slot = cls(lq, (n, k))
        if lq.act_quant is not None:  # FastLLM scales its integer dot in float32: so do these matmuls
            slot.compute_dtype = torch.float32
        if lq.algo in PERMUTED_ALGOS:
            linear.in_perm = _param(torch.empty(k, dtype=torch.int32, device=device))
            slot.in_offset = linear.tp_rank * k if linear.parallel == "row" and linear.tp_size > 1 else 0
        linear.quant = slot
        return slot

    def tp_dim(self, name: str, weight_dim: int, is_column: bool) -> int:
        """Slicing dim of tensor `name` given the weight's (`weight_dim`): scales follow the out
        dim of a column-parallel layer and, group-wise only, the group dim of a row-parallel one."""
        if name == "weight" or weight_dim < 0:
            return weight_dim
        if name == "in_perm":
            return -1 if is_column else 0
        if is_column:
            return 0
        return 1 if self.lq.bits == 4 else -1

    def quantize(self, w: torch.Tensor, scale_dtype: torch.dtype, stats: LinearInputStats | None = None,
                 row_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Float weight [N, K] -> {parameter name: tensor} in the checkpoint layout.

        Round to nearest, or, int4 with `stats` (core.quant.input_stats.LinearInputStats
        holding the input Hessian), GPTQ (core.quant.gptq). int8 `row_amax` [N]: the whole rows'
        max |w| of a row-parallel rank (its per-channel scales are replicated: tp_dim -1)."""
        if tuple(w.shape) != (self.out_local, self.in_local):
            raise ValueError(f"weight {tuple(w.shape)} does not match the layer's {(self.out_local, self.in_local)}")
        return self._quantize(w, scale_dtype, stats, row_amax)

    def streams_rows(self) -> bool:
        """Whether the weight can be rounded a block of rows at a time (`quantize_rows`): round to
        nearest, every tensor of the checkpoint layout one row per output row (no in_perm)."""
        return self.lq.algo not in PERMUTED_ALGOS

    def quantize_rows(self, w: torch.Tensor, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Rows [n, K] of the weight, rounded to nearest -> their rows of every checkpoint tensor: the
        whole weight's `quantize` is these concatenated along dim 0 (rows are rounded independently)."""
        if w.shape[1] != self.in_local or not self.streams_rows():
            raise ValueError(f"weight rows {tuple(w.shape)} cannot be quantized apart ({self.lq.algo}, K {self.in_local})")
        return self._quantize(w, scale_dtype)

    def _quantize(self, w: torch.Tensor, scale_dtype: torch.dtype, stats: LinearInputStats | None = None,
                  row_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self.lq.bits == 8:
            if stats is not None:
                raise ValueError("int8 weights are rounded to nearest: no calibration statistics expected")
            q, s = packing.quantize_int8_per_channel(w, row_amax)
            out = {"weight": q, "weights_scaling_factor": s.to(scale_dtype)}
            if self.lq.has_zero_point:  # symmetric rounding: zero points 0
                out["zeros"] = torch.zeros_like(out["weights_scaling_factor"])
            return out
        return self.pack_int4(self.int4_codes(w, scale_dtype, stats), scale_dtype)

    def int4_codes(self, w: torch.Tensor, scale_dtype: torch.dtype, stats: LinearInputStats | None = None) -> Int4Codes:
        """Float weight [N, K] -> its int4 codes and scales: GPTQ with `stats` holding the input
        Hessian, else round to nearest; scales rounded to `scale_dtype` as stored."""
        if stats is not None and stats.hessian is not None:
            from bestiary.core.quant.gptq import gptq_int4

            codes, s, z = gptq_int4(w, stats.hessian, self.lq.group_size, self.lq.has_zero_point,
                                    scale_dtype=scale_dtype)
        else:
            codes, s, z = packing.quantize_int4_groupwise(w, self.lq.group_size, self.lq.has_zero_point)
        return Int4Codes(codes, s, z, self.lq.group_size)

    def pack_int4(self, layer: Int4Codes, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Codes and scales -> {parameter name: tensor} in the checkpoint layout."""
        out = {"weight": packing.pack_int4(layer.codes), "weights_scaling_factor": layer.s.to(scale_dtype)}
        if layer.z is not None:
            out["zeros"] = layer.z.to(scale_dtype)
        if self.lq.algo in PERMUTED_ALGOS:  # quantized in the given feature order: identity
            out["in_perm"] = torch.arange(self.in_offset, self.in_offset + self.in_local, dtype=torch.int32)
        return out

    # --- reading the weight back -------------------------------------------------------------
    def codes(self, linear: Linear) -> torch.Tensor:
        """int4: codes uint8 [N, K] from whichever layout the weight is in."""
        w = linear.weight
        if self.layout == "cpu":
            return packing.unpack_int4_cpu(w)[:, : self.in_local]  # drop the padded features
        if self.layout == "dot":
            return packing.unpack_int4_dot(w)
        return packing.unpack_int4(packing.unpack_int4_quads(w) if self.layout == "quads" else w)

    def dequantize(self, linear: Linear) -> torch.Tensor:
        """The float32 weight [N, K] the packed tensors stand for: (q - z) * s per row (int8) or per group
        (z absent: 0 for int8, 8 for int4) (with an in_perm, over the permuted in-features: y = x[..., in_perm] W^T)."""
        s = linear.weights_scaling_factor
        z = getattr(linear, "zeros", None)
        if self.lq.bits == 8:
            q = packing.unpack_int8_tiled(linear.weight) if self.layout == "tiled" else linear.weight
            return packing.dequantize_int8(q, s, z)
        return packing.dequantize_int4(self.codes(linear), s, z, self.lq.group_size)

    # --- running -----------------------------------------------------------------------------
    def prepare(self, linear: Linear) -> None:
        """Repack for the device the layer now lives on (idempotent)."""
        self._perm_device = None  # in_perm is looked at again on the next matmul
        self._packed = None
        self._kernel_bound = DEFAULT_MAX_KERNEL_TOKENS
        if linear.weight.device.type != "cpu":
            self._to_checkpoint_layout(linear)  # the device kernels read the checkpoint layout
            return
        s = linear.weights_scaling_factor
        if self.runs_compiled(linear):
            ops = dispatch.cpu_ops()
            if "amx_bf16" not in cpu_flags():  # with AMX, torch's bf16 GEMM wins past the aten bound
                self._kernel_bound = COMPILED_MAX_TOKENS.get(isa_name(library()), {}).get(self.lq.bits,
                                                                                         DEFAULT_MAX_KERNEL_TOKENS)
            if self.lq.bits == 8:
                if self.layout == "checkpoint" and packing.int8_tiles_fit(*linear.weight.shape):  # in place
                    data = linear.weight.data
                    linear.weight = _param(packing.pack_int8_tiled(data, in_place=cpu_matmul.may_repack_in_place(data)))
                    self.layout = "tiled"
                if self.lq.act_quant == "int8" and self.layout == "tiled":  # W8A8 dynamic: every step on the kernel
                    self._packed = ops.PackedWeight.int8_a8(linear.weight, s)
                    return
                self._packed = ops.PackedWeight.int8(linear.weight, s, tiled=self.layout == "tiled")
                return
            k, z = linear.weight.shape[1] * 2, getattr(linear, "zeros", None)
            if self.lq.act_quant == "int8" and ops.w4a8_fits(k, self.lq.group_size):  # W4A8: every step on the kernel
                self._repack_int4(linear, "quads")  # (prepared again: the quads stay, fused members' views on them too)
                self._packed = ops.PackedWeight.int4_a8(linear.weight, s, z, self.lq.group_size, quads=True)
                return
            # the layout this build's GEMV reads fastest: the dot layout where the activations are bfloat16
            # (the layer's dtype, its scales'; float32 inputs run faster on the checkpoint layout there), the
            # quads on the avx2 build, else the checkpoint layout
            self._repack_int4(linear, ops.int4_layout(k, bfloat16=s.dtype == torch.bfloat16 and self.lq.act_quant is None))
            self._packed = ops.PackedWeight.int4(linear.weight, s, z, self.lq.group_size, layout=self.layout)
            if self.layout == "quads" and (s.dtype != torch.bfloat16 or self.lq.act_quant is not None):  # float32 x
                self._kernel_bound = min(self._kernel_bound, QUADS_FLOAT_MAX_TOKENS)
            return
        self._to_checkpoint_layout(linear)  # the aten kernels read the checkpoint layout
        if self.lq.bits == 8:
            self._kernel_scales = s.to(self.compute_dtype).contiguous()
            return
        if self.out_local % 16 or self.lq.act_quant == "int8":
            return  # the aten layout needs N % 16 == 0; W4A8: x's int8 reading x the dequantized weight (float32)
        if self.layout != "cpu":
            codes = packing.unpack_int4(linear.weight).to(torch.int32)  # [N, K]
            self.k_pad = -self.in_local % self.lq.group_size  # a short last group: pad it to full size
            codes = F.pad(codes, (0, self.k_pad))  # [N, K + pad]; the padded x columns are 0
            linear.weight = _param(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.layout = "cpu"
        z = getattr(linear, "zeros", None)
        self._kernel_scales = packing.int4_cpu_scale_zeros(s, z, self.compute_dtype)

    def _repack_int4(self, linear: Linear, layout: str) -> None:
        """An int4 weight into `layout` ("checkpoint", "dot" or "quads"), through the checkpoint layout when it is
        in another one (another build may have been loaded since: BESTIARY_CPU_ISA); nothing when it is there."""
        if self.layout == layout:
            return
        self._to_checkpoint_layout(linear)
        data = linear.weight.data  # in place where it owns its memory: no second copy of the codes
        if layout == "dot":
            linear.weight = _param(packing.pack_int4_dot(data))
        elif layout == "quads":
            linear.weight = _param(packing.pack_int4_quads(data, in_place=cpu_matmul.may_repack_in_place(data)))
        self.layout = layout

    def _to_checkpoint_layout(self, linear: Linear) -> None:
        """An int4 weight in the dot / quads layout, int8 in tiles back into the checkpoint layout, in place."""
        if self.layout == "dot":
            linear.weight = _param(packing.pack_int4(self.codes(linear)))
        elif self.layout == "quads":
            linear.weight = _param(packing.unpack_int4_quads(linear.weight.data))
        elif self.layout == "tiled":
            linear.weight = _param(packing.unpack_int8_tiled(linear.weight.data))
        else:
            return
        self.layout = "checkpoint"

    def runs_compiled(self, linear: Linear) -> bool:
        """True when the compiled CPU kernels (core.kernels.cpu) run this layer (checkpoint or dot layout)."""
        kernel_group = self.lq.bits == 8 or self.lq.group_size % 32 == 0
        return (self.layout in ("checkpoint", "dot", "quads", "tiled") and kernel_group
                and dispatch.use_cpu_kernels(linear.weights_scaling_factor))

    def set_compute_dtype(self, linear: Linear, dtype: torch.dtype) -> None:
        """Run the matmuls in `dtype` (float32 makes the layer exact to fp32 rounding: tests)."""
        self.compute_dtype = dtype
        self.prepare(linear)

    def fuse(self, members: list[Linear]) -> Linear | None:
        """One quantized Linear computing [x W1^T, x W2^T, ...] for `members` (this slot's linear first;
        core.quant.fuse), or None when their layouts cannot be stacked."""
        from bestiary.core.quant.fuse import fuse_quantized

        return fuse_quantized(members)

    def matmul(self, linear: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> x W^T + b [..., N] in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        if self.lq.act_quant == "int8":  # W8A8 / W4A8 dynamic: the kernel quantizes x2, else x2 <- its int8 reading
            x2 = x2 if self.runs_a8_kernel() else online_act.int8_per_token(x2)
        elif self.lq.act_quant is not None:  # quantization.activation_quant: x2 <- its uint8 reading, float32
            x2 = online_act.fastllm_uint8(x2, self.lq.act_group, min_code=1 if self.lq.bits == 8 else 0)
        zero_term = getattr(linear, "zeros", None) if self.lq.bits == 8 else None  # int8 kernels have no z
        perm = self.input_perm(linear, x.device)
        if perm is not None:
            x2 = x2.index_select(1, perm)  # [T, K] in the weight's (group-contiguous) feature order
        if x.device.type != "cpu":
            y = self._device_matmul(linear, x2)
        elif self._packed is not None and x2.dtype in (torch.float32, torch.bfloat16):
            y = self._compiled_matmul(x2).to(x.dtype)
        else:
            xc = x2.to(self.compute_dtype)
            if x2.shape[0] <= self.kernel_max_tokens() and self._kernel_scales is not None:
                y = self._cpu_kernel(linear, xc)
            else:
                y = cpu_matmul.dense_weight_matmul(xc, self.dequantize(linear))  # fp32 GEMM without native bf16
                zero_term = None  # the dequantized weight holds the zero points
            y = y.to(x.dtype)
        if zero_term is not None:  # x (q - z)^T s = x q^T s - (sum_k x) (s z)
            y = y - (x2.float().sum(-1, keepdim=True) * (linear.weights_scaling_factor.float() * zero_term.float())).to(y.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def runs_a8_kernel(self) -> bool:
        """True when a compiled int8-activation kernel runs this layer (activation_quant "int8": KIND_I8A8 on
        int8 row tiles, KIND_I4A8 on int4 codes)."""
        ops = dispatch.cpu_ops()
        return self._packed is not None and self._packed.kind in (ops.KIND_I8A8, ops.KIND_I4A8)

    def _compiled_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """The compiled kernels (core.kernels.cpu): GEMV at <= kernel_max_tokens() rows, else the weight
        dequantized (float32 without native bf16 GEMMs) and one dense matmul. x2 [T, K] -> [T, N]."""
        ops = dispatch.cpu_ops()
        assert self._packed is not None  # (matmul calls this only then)
        if x2.shape[0] <= self.kernel_max_tokens() or self.runs_a8_kernel():  # int8 activations: any T
            return ops.linear(x2, self._packed)
        dtype = self.compute_dtype if cpu_matmul.native_half_gemm(self.compute_dtype) else torch.float32
        w = ops.dequantize(self._packed, dtype)  # [N, K]
        return F.linear(x2.to(dtype), w).to(x2.dtype)

    def kernel_max_tokens(self) -> int:
        """Rows up to which a CPU step runs the weight-only kernel: `max_kernel_tokens` when set
        (set_max_kernel_tokens), else COMPILED_MAX_TOKENS of the compiled kernels' build (not with
        AMX), else DEFAULT_MAX_KERNEL_TOKENS."""
        return self._kernel_bound if self.max_kernel_tokens is None else self.max_kernel_tokens

    def input_perm(self, linear: Linear, device: torch.device) -> torch.Tensor | None:
        """Local in_perm (int64, on `device`) the input is gathered by, None when identity or absent."""
        if self._perm_device != device:
            perm = getattr(linear, "in_perm", None)
            local = None if perm is None else perm.to(device=device, dtype=torch.int64) - self.in_offset
            identity = local is None or torch.equal(local, torch.arange(self.in_local, device=device))
            self._perm, self._perm_device = (None if identity else local), device
        return self._perm

    def _cpu_kernel(self, linear: Linear, xc: torch.Tensor) -> torch.Tensor:
        """The aten weight-only kernels: xc [T, K] in the compute dtype -> [T, N]."""
        if self.lq.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(xc.contiguous(), linear.weight, self._kernel_scales)
        if self.k_pad:
            xc = F.pad(xc, (0, self.k_pad))  # [T, K + pad]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            xc.contiguous(), linear.weight, self.lq.group_size, self._kernel_scales)

    def _device_matmul(self, linear: Linear, x2: torch.Tensor) -> torch.Tensor:
        """CUDA and other devices: the Triton weight-only GEMMs on the checkpoint layout."""
        from bestiary.core.kernels import dispatch

        s = linear.weights_scaling_factor
        if self.lq.bits == 8:
            return dispatch.woq_int8_linear(x2, linear.weight, s)
        z = getattr(linear, "zeros", None)
        if self.lq.group_size in (64, 128) and self.in_local % self.lq.group_size == 0:
            return dispatch.woq_int4_linear(x2, linear.weight, s, z, self.lq.group_size)
        return F.linear(x2, self.dequantize(linear).to(x2.dtype))
