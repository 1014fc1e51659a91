"""`bestiary convert` quantization flags -> the checkpoint's `quantization` section.

    --use_weight_only --weight_only_precision int8      -> W8A16 (int8 per output channel)
    --use_weight_only --weight_only_precision int4      -> W4A16 (group-wise, --group_size,
                                                           --has_zero_point)
    --int8_kv_cache / --fp8_kv_cache                    -> kv_cache_quant_algo INT8 / FP8
    --exclude_modules NAME ...                          -> exclude_modules (globs over module names)

Flag combinations that make no sense are refused here with a one-line ConfigError, before
anything is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bestiary.core.config import QuantConfig
from bestiary.core.errors import ConfigError
from bestiary.core.quant.modes import GROUP_SIZES

PRECISIONS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 128


@dataclass
class QuantFlags:
    """The convert command's quantization flags, as given (None: not given)."""

    use_weight_only: bool = False
    weight_only_precision: str | None = None
    group_size: int | None = None
    has_zero_point: bool = False
    exclude_modules: list[str] | None = field(default=None)
    int8_kv_cache: bool = False
    fp8_kv_cache: bool = False

    def any(self) -> bool:
        """True if any quantization flag was given."""
        return bool(self.use_weight_only or self.weight_only_precision or self.group_size or self.has_zero_point
                    or self.exclude_modules or self.int8_kv_cache or self.fp8_kv_cache)


def _weight_only(flags: QuantFlags) -> dict:
    precision = flags.weight_only_precision or "int8"
    if precision not in PRECISIONS:
        raise ConfigError(f"--weight_only_precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "int8":
        if flags.group_size is not None or flags.has_zero_point:
            flag = "--group_size" if flags.group_size is not None else "--has_zero_point"
            raise ConfigError(f"{flag}: only for --weight_only_precision int4 (int8 is per output channel)")
        return {"quant_algo": "W8A16"}
    group = flags.group_size if flags.group_size is not None else DEFAULT_GROUP_SIZE
    if group not in GROUP_SIZES:
        raise ConfigError(f"--group_size {group}: expected one of {', '.join(map(str, GROUP_SIZES))}")
    return {"quant_algo": "W4A16", "group_size": group, "has_zero_point": flags.has_zero_point}


def quant_config_from_flags(flags: QuantFlags) -> QuantConfig:
    """The `quantization` section the flags ask for (ConfigError naming the flag when they conflict)."""
    section: dict = {}
    if flags.use_weight_only:
        section.update(_weight_only(flags))
    else:
        for flag, given in (("--weight_only_precision", flags.weight_only_precision), ("--group_size", flags.group_size),
                            ("--has_zero_point", flags.has_zero_point), ("--exclude_modules", flags.exclude_modules)):
            if given:
                raise ConfigError(f"{flag}: needs a weight quantization mode (--use_weight_only)")
    if flags.int8_kv_cache and flags.fp8_kv_cache:
        raise ConfigError("--int8_kv_cache and --fp8_kv_cache: pick one")
    if flags.int8_kv_cache or flags.fp8_kv_cache:
        section["kv_cache_quant_algo"] = "INT8" if flags.int8_kv_cache else "FP8"
    if flags.exclude_modules:
        section["exclude_modules"] = list(flags.exclude_modules)
    return QuantConfig(**section)
