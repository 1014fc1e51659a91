"""`ConvertOptions`: what `bestiary convert` makes of a source (dtype, splits, quantization, calibration).

One frozen pydantic model holds every option of a conversion; `convert(model_dir, output_dir, options)`
(core.convert.source_to_checkpoint) takes it, with only the run context (registry, progress bars) beside
it. What can be checked without the source is checked when the options are made, with the one-line
`BestiaryError` / `ConfigError` the CLI prints (`--tp_size 0: expected a positive integer`); what needs the
source (its layer count, its architecture's support, an AWQ/GPTQ checkpoint's own quantization) is
checked by `convert` before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bestiary.core.format.config import MAX_RANKS, Mapping, QuantConfig, moe_split
from bestiary.core.format.errors import BestiaryError, ConfigError

DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}
WEIGHT_QUANTIZERS = ("rtn", "gptq")  # core.convert.quantize_calibrated: round to nearest, GPTQ


def expert_mapping(tp_size: int, pp_size: int, moe_tp_size: int | None = None,
                   moe_ep_size: int | None = None) -> Mapping:
    """The Mapping of the convert flags; a bad --moe_tp_size / --moe_ep_size is a one-line error."""
    for flag, value in (("--moe_tp_size", moe_tp_size), ("--moe_ep_size", moe_ep_size)):
        if value is not None and value < 1:
            raise BestiaryError(f"{flag} {value}: expected a positive integer")
    try:
        moe_tp, moe_ep = moe_split(tp_size, moe_tp_size, moe_ep_size)
    except ValueError:
        given = " ".join(f"{f} {v}" for f, v in (("--moe_tp_size", moe_tp_size), ("--moe_ep_size", moe_ep_size))
                         if v is not None)
        raise BestiaryError(f"{given}: moe_tp_size * moe_ep_size must equal --tp_size {tp_size}") from None
    return Mapping(tp_size=tp_size, pp_size=pp_size, moe_tp_size=moe_tp, moe_ep_size=moe_ep)


class ConvertOptions(BaseModel):
    """Everything a conversion does to the source: `bestiary convert`'s flags as one value.

    Checked when made (the errors name the CLI flag): dtype, positive tp / pp / MoE splits that
    multiply out, the embedding sharding dim, the weight quantizer's name, a non-negative tune step
    count and the SmoothQuant strength. `options.model_copy(update=...)` derives a variant (the tp 1
    conversions that calibrated tp / pp checkpoints are cut from)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --- what the checkpoint holds
    dtype: str = Field("auto", description="Dtype of the float weights: auto (the source's torch_dtype, else "
                                           "float32), float32 / fp32, float16 / fp16 or bfloat16 / bf16.")
    architecture: str | None = Field(None, description="Registered architecture name (or HF architectures "
                                                       "entry) to convert as; default: the one the source names.")
    customized_key_dict: dict[str, Any] | None = Field(
        None, description="Key-map sections overriding every other map for this conversion: canonical section -> "
                          "source section(s), as a spec's key_map (docs/add-an-architecture.md#the-key-map).")
    allow_nonfinite: bool = Field(False, description="Accept source tensors holding NaN or inf values "
                                                     "(refused by default).")
    # --- how it is split
    tp_size: int = Field(1, description="Tensor-parallel ranks.")
    pp_size: int = Field(1, description="Pipeline-parallel stages (at most the model's layer count).")
    moe_tp_size: int | None = Field(None, description="MoE architectures: ranks each expert's FFN dim is split "
                                                      "over; moe_tp_size * moe_ep_size = tp_size (one given "
                                                      "derives the other; default tp_size).")
    moe_ep_size: int | None = Field(None, description="MoE architectures: ranks the experts are spread over, "
                                                      "E / moe_ep_size whole experts each (expert parallelism; "
                                                      "default 1).")
    use_parallel_embedding: bool = Field(False, description="Split the embedding over the tp ranks "
                                                            "(core.layers.embedding).")
    embedding_sharding_dim: int = Field(0, description="With use_parallel_embedding: 0 splits the vocab, "
                                                       "1 the hidden dim.")
    # --- quantization
    quantization: QuantConfig | None = Field(
        None, description="The quantization section written to config.json: linear weights and / or a "
                          "quantized KV cache (core.quant.options makes it from the CLI flags).")
    calib_text: str | Path | None = Field(
        None, description="Text file the calibration runs over (KV cache scales, GPTQ, activation scales); "
                          "default: the built-in texts (core.quant.calib_text).")
    weight_quantizer: str | None = Field(
        None, description="rtn (round to nearest) or gptq; default gptq for int4 weights, rtn otherwise "
                          "(core.convert.quantize_calibrated).")
    smoothquant_alpha: float | None = Field(
        None, description="W8A8_SQ_PER_CHANNEL's migration strength, 0 < alpha <= 1 (default 0.5; "
                          "core.quant.act_slot).")
    tune_steps: int | None = Field(
        None, description="Steps of end-to-end scale tuning after GPTQ: default core.convert.tune.DEFAULT_STEPS "
                          "for GPTQ int4, 0 otherwise; 0 = none.")

    @model_validator(mode="after")
    def _check(self) -> ConvertOptions:
        """The one-line errors of the flags that need no source (BestiaryError passes through pydantic)."""
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise BestiaryError(f"--dtype {self.dtype!r}: expected auto, float32, float16 or bfloat16")
        for flag, value in (("--tp_size", self.tp_size), ("--pp_size", self.pp_size)):
            if value < 1:
                raise BestiaryError(f"{flag} {value}: expected a positive integer")
            if value > MAX_RANKS:
                raise BestiaryError(f"{flag} {value}: expected a positive integer of at most {MAX_RANKS}")
        if self.tp_size * self.pp_size > MAX_RANKS:
            raise BestiaryError(f"--tp_size {self.tp_size} * --pp_size {self.pp_size}: more than {MAX_RANKS} ranks")
        self.mapping()  # --moe_tp_size / --moe_ep_size: positive, multiplying to --tp_size
        if self.use_parallel_embedding and self.embedding_sharding_dim not in (0, 1):
            raise BestiaryError(f"--embedding_sharding_dim {self.embedding_sharding_dim}: "
                                "expected 0 (vocab) or 1 (hidden)")
        self._check_quantizer_flags()
        return self

    def _check_quantizer_flags(self) -> None:
        """--weight_quantizer's name, --tune_steps' sign and --smoothquant's range (ConfigError, as the
        checks against the quantization mode in core.convert.quantize_calibrated / core.quant.act_slot)."""
        if self.weight_quantizer is not None and self.weight_quantizer not in WEIGHT_QUANTIZERS:
            raise ConfigError(f"--weight_quantizer {self.weight_quantizer!r}: "
                              f"expected one of {', '.join(WEIGHT_QUANTIZERS)}")
        if self.tune_steps is not None and self.tune_steps < 0:
            raise ConfigError(f"--tune_steps {self.tune_steps}: expected 0 (no tuning) or a positive number of steps")
        if self.smoothquant_alpha is not None and not 0 < self.smoothquant_alpha <= 1:
            raise ConfigError(f"--smoothquant {self.smoothquant_alpha}: "
                              "expected a migration strength alpha with 0 < alpha <= 1")

    def mapping(self) -> Mapping:
        """How the checkpoint is split over ranks (tp, pp and the MoE expert split)."""
        return expert_mapping(self.tp_size, self.pp_size, self.moe_tp_size, self.moe_ep_size)

    def tp1(self, **update: Any) -> ConvertOptions:
        """These options at tp 1, pp 1 (no MoE split) with `update` on top: the whole-model conversion a
        calibrated tp / pp checkpoint, or its KV cache scales, is cut from."""
        return self.model_copy(update={"tp_size": 1, "pp_size": 1, "moe_tp_size": None, "moe_ep_size": None,
                                       **update})
