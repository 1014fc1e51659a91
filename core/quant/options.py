"""`bestiary convert` quantization flags -> the checkpoint's `quantization` section.

    --use_weight_only --weight_only_precision int8      -> W8A16 (int8 per output channel)
    --use_weight_only --weight_only_precision int8 --activation_precision int8
                                                        -> W8A16 + activation_quant int8 (W8A8 dynamic)
    --use_weight_only --weight_only_precision int4      -> W4A16 (group-wise, --group_size,
                                                           --has_zero_point)
    --use_weight_only --weight_only_precision int4 --activation_precision int8
                                                        -> W4A16 + activation_quant int8 (W4A8 dynamic)
    --fp8                                               -> FP8 (e4m3 weights and activations)
    --smoothquant ALPHA                                 -> W8A8_SQ_PER_CHANNEL (SmoothQuant, 0 < ALPHA <= 1)
    --w4a8_awq [--group_size N]                         -> W4A8_AWQ (int4 AWQ weights, FP8 activations)
    --int8_kv_cache / --fp8_kv_cache                    -> kv_cache_quant_algo INT8 / FP8
    --weight_quantizer rtn|gptq                         -> how the weights are rounded (default: gptq for
                                                           weight-only int4; checked by
                                                           core.convert.quantize_calibrated.check_weight_quantizer)
    --exclude_modules NAME ...                          -> exclude_modules (globs over module names)

Flag combinations that make no sense are refused here with a one-line ConfigError, before
anything is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.quant.modes import GROUP_SIZES

PRECISIONS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 128


@dataclass
class QuantFlags:
    """The convert command's quantization flags, as given (None: not given)."""

    use_weight_only: bool = False
    weight_only_precision: str | None = None
    activation_precision: str | None = None  # int8: W8A16 / W4A16 weights with int8 activations (W8A8 / W4A8 dynamic)
    group_size: int | None = None
    has_zero_point: bool = False
    exclude_modules: list[str] | None = field(default=None)
    int8_kv_cache: bool = False
    fp8_kv_cache: bool = False
    fp8: bool = False
    smoothquant: float | None = None  # SmoothQuant alpha
    w4a8_awq: bool = False
    weight_quantizer: str | None = None  # rtn | gptq: a convert-time choice, not part of the section

    def any(self) -> bool:
        """True if any quantization flag was given."""
        return bool(self.use_weight_only or self.weight_only_precision or self.activation_precision or self.group_size
                    or self.has_zero_point
                    or self.exclude_modules or self.int8_kv_cache or self.fp8_kv_cache or self.fp8
                    or self.smoothquant is not None or self.w4a8_awq)

    def weight_modes(self) -> list[str]:
        """The weight quantization mode flags given (at most one is allowed)."""
        given = (("--use_weight_only", self.use_weight_only), ("--fp8", self.fp8),
                 ("--smoothquant", self.smoothquant is not None), ("--w4a8_awq", self.w4a8_awq))
        return [flag for flag, on in given if on]


def _weight_only(flags: QuantFlags) -> dict:
    precision = flags.weight_only_precision or "int8"
    if precision not in PRECISIONS:
        raise ConfigError(f"--weight_only_precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "int8":
        if flags.group_size is not None or flags.has_zero_point:
            flag = "--group_size" if flags.group_size is not None else "--has_zero_point"
            raise ConfigError(f"{flag}: only for --weight_only_precision int4 (int8 is per output channel)")
        if flags.activation_precision is not None:
            return {"quant_algo": "W8A16", "activation_quant": flags.activation_precision}
        return {"quant_algo": "W8A16"}
    group = flags.group_size if flags.group_size is not None else DEFAULT_GROUP_SIZE
    if group not in GROUP_SIZES:
        raise ConfigError(f"--group_size {group}: expected one of {', '.join(map(str, GROUP_SIZES))}")
    section = {"quant_algo": "W4A16", "group_size": group, "has_zero_point": flags.has_zero_point}
    if flags.activation_precision is not None:  # W4A8 dynamic
        section["activation_quant"] = flags.activation_precision
    return section


def _activation_mode(flags: QuantFlags) -> dict:
    """--fp8 / --smoothquant ALPHA / --w4a8_awq -> their section (core.quant.act_slot)."""
    mode = flags.weight_modes()[0]
    if flags.weight_only_precision or flags.activation_precision:
        flag = "--weight_only_precision" if flags.weight_only_precision else "--activation_precision"
        raise ConfigError(f"{flag}: only with --use_weight_only, not with {mode}")
    if flags.has_zero_point:
        raise ConfigError(f"--has_zero_point: not with {mode} (its weights are symmetric)")
    if not flags.w4a8_awq and flags.group_size is not None:
        raise ConfigError(f"--group_size: not with {mode} (only int4 modes are group-wise)")
    if flags.fp8:
        return {"quant_algo": "FP8"}
    if flags.smoothquant is not None:
        alpha = flags.smoothquant
        if not 0 < alpha <= 1:
            raise ConfigError(f"--smoothquant {alpha}: expected a migration strength alpha with 0 < alpha <= 1")
        return {"quant_algo": "W8A8_SQ_PER_CHANNEL", "pre_quant_scale": True}
    group = flags.group_size if flags.group_size is not None else DEFAULT_GROUP_SIZE
    if group not in GROUP_SIZES:
        raise ConfigError(f"--group_size {group}: expected one of {', '.join(map(str, GROUP_SIZES))}")
    return {"quant_algo": "W4A8_AWQ", "group_size": group, "pre_quant_scale": True}


def quant_config_from_flags(flags: QuantFlags) -> QuantConfig:
    """The `quantization` section the flags ask for (ConfigError naming the flag when they conflict)."""
    section: dict = {}
    modes = flags.weight_modes()
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)}: pick one weight quantization mode")
    if flags.use_weight_only:
        section.update(_weight_only(flags))
    elif modes:
        section.update(_activation_mode(flags))
    else:
        for flag, given in (("--weight_only_precision", flags.weight_only_precision),
                            ("--activation_precision", flags.activation_precision), ("--group_size", flags.group_size),
                            ("--has_zero_point", flags.has_zero_point), ("--exclude_modules", flags.exclude_modules)):
            if given:
                raise ConfigError(f"{flag}: needs a weight quantization mode "
                                  "(--use_weight_only, --fp8, --smoothquant or --w4a8_awq)")
    if flags.int8_kv_cache and flags.fp8_kv_cache:
        raise ConfigError("--int8_kv_cache and --fp8_kv_cache: pick one")
    if flags.int8_kv_cache or flags.fp8_kv_cache:
        section["kv_cache_quant_algo"] = "INT8" if flags.int8_kv_cache else "FP8"
    if flags.exclude_modules:
        section["exclude_modules"] = list(flags.exclude_modules)
    return QuantConfig(**section)
