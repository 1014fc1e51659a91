"""Which quantization a linear layer gets, from the checkpoint's `quantization` section.

    quant_algo      weight layout held by every selected Linear
    W8A16           int8 per output channel (optional zero points), 16-bit activations; with
                    activation_quant "int8": W8A8 dynamic (int8 activations per token, core.quant.slot)
    W4A16           int4 group-wise (group_size, optional zero points), 16-bit activations; with
                    activation_quant "int8": W4A8 dynamic (int8 activations per token, core.quant.slot)
    W4A16_AWQ       W4A16 with zero points (imported from AWQ checkpoints)
    W4A16_GPTQ      W4A16 with zero points (imported from GPTQ checkpoints)
    FP8                 float8 e4m3 per tensor, FP8 activations (core.quant.act_slot)
    W8A8_SQ_PER_CHANNEL int8 per output channel, SmoothQuant prequant scale, int8 activations
    W4A8_AWQ            int4 group-wise symmetric, AWQ prequant scale, FP8 activations

A Linear is selected unless its canonical name matches one of `exclude_modules` (a glob
matched against the whole name or any dotted suffix of it: "lm_head", "mlp.proj",
"*.attention.qkv"). Everything that can be refused is refused from shapes alone, before
a weight is read: `check_linear` raises ConfigError with a one-line reason.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError

GROUP_SIZES = (32, 64, 128)
INT8_ALGOS = ("W8A16",)
INT4_ALGOS = ("W4A16", "W4A16_AWQ", "W4A16_GPTQ")
WEIGHT_ONLY_ALGOS = INT8_ALGOS + INT4_ALGOS
A8_ALGOS = ("W8A16", "W4A16")  # activation_quant "int8": W8A8 / W4A8 dynamic (core.quant.slot)
ACT_ALGOS = ("FP8", "W8A8_SQ_PER_CHANNEL", "W4A8_AWQ")  # activations quantized too: core.quant.act_slot


@dataclass(frozen=True)
class LinearQuant:
    """How one Linear's weight is stored: bits 8 (per channel) or 4 (group-wise)."""

    algo: str
    bits: int
    group_size: int = 0  # 0: per output channel
    has_zero_point: bool = False
    act_quant: str | None = None  # weight-only: dynamic input quantization (core.quant.online_act)
    act_group: int | None = None  # its group of inputs (None: the whole row)


def linear_quant_of(quant: QuantConfig) -> LinearQuant | None:
    """The weight layout of `quant`'s algorithm (None: weights stay float)."""
    algo = quant.quant_algo
    if quant.activation_quant is not None and algo not in WEIGHT_ONLY_ALGOS:
        raise ConfigError(f"quantization.activation_quant {quant.activation_quant!r}: only with a weight-only "
                          f"quant_algo ({', '.join(WEIGHT_ONLY_ALGOS)}), not {algo!r}")
    act_quant, act_group = quant.activation_quant, quant.activation_group_size
    if algo is None:
        return None
    int8_zp = algo in INT8_ALGOS and quant.has_zero_point
    if act_quant == "int8" and (algo not in A8_ALGOS or int8_zp or act_group is not None):
        raise ConfigError(f"quantization.activation_quant 'int8' (W8A8 / W4A8 dynamic): only with symmetric W8A16 or "
                          f"W4A16 weights and per-token scales (no activation_group_size), not {algo!r}"
                          + (" with zero points" if int8_zp else "")
                          + (f" with activation_group_size {act_group}" if act_group is not None else ""))
    if algo in INT8_ALGOS:  # zero points: imported asymmetric int8 (FastLLM .flm)
        return LinearQuant(algo, 8, has_zero_point=quant.has_zero_point, act_quant=act_quant, act_group=act_group)
    if algo in INT4_ALGOS:
        zero = quant.has_zero_point or algo != "W4A16"
        return LinearQuant(algo, 4, quant.group_size, zero, act_quant, act_group)
    if algo in ("FP8", "W8A8_SQ_PER_CHANNEL"):
        return LinearQuant(algo, 8)
    if algo == "W4A8_AWQ":
        if quant.has_zero_point:
            raise ConfigError("quantization.has_zero_point true: W4A8_AWQ weights are symmetric (no zero points)")
        return LinearQuant(algo, 4, quant.group_size)
    raise ConfigError(
        f"quantization.quant_algo {algo!r}: not available; expected one of {', '.join(WEIGHT_ONLY_ALGOS + ACT_ALGOS)}"
    )


def is_excluded(name: str, patterns: list[str] | None) -> bool:
    """True if module `name` matches an exclude pattern (whole name or a dotted suffix)."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}") for p in patterns or ())


def quantizes(name: str, quant: QuantConfig) -> bool:
    """True if the Linear called `name` holds quantized weights under `quant`."""
    return quant.quant_algo is not None and not is_excluded(name, quant.exclude_modules)


def check_linear(name: str, in_local: int, out_local: int, lq: LinearQuant, split_in: bool = False) -> None:
    """Refuse a layout this layer cannot take (ConfigError, one line naming the layer).

    A group size that does not divide the in-features is fine on one rank (the last group is
    shorter), but not when the in-features are split over tensor-parallel ranks (row-parallel,
    `split_in`): a group would straddle two ranks."""
    if lq.bits != 4:
        return
    short = ".".join(name.split(".")[-2:]) if "." in name else name
    if lq.group_size not in GROUP_SIZES:
        raise ConfigError(f"--group_size {lq.group_size}: expected one of {', '.join(map(str, GROUP_SIZES))}")
    if split_in and in_local % lq.group_size:
        raise ConfigError(
            f"--group_size {lq.group_size}: {name} has {in_local} input features per tensor-parallel rank, "
            f"not a multiple of the group size; pick another group size or --tp_size, "
            f"or --exclude_modules {short}"
        )
    if in_local % 2:
        raise ConfigError(f"{name}: int4 packing needs an even number of input features, got {in_local}")
