"""The settings of speculative decoding (core.runtime.speculative), torch-free so the CLI can
build its flags from them without importing the runtime."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bestiary.core.format.errors import BestiaryError


class SpeculativeConfig(BaseModel):
    """How a runtime drafts tokens for speculative decoding (`LLM(speculative=...)`, `--speculative`)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft"] = Field(description="ngram: prompt lookup; draft: a draft engine.")
    num_draft_tokens: int = Field(4, ge=1, le=64, description="Tokens drafted per step and sequence (k).")
    draft_engine_dir: str | None = Field(None, description="The draft engine (method draft): same vocabulary.")
    ngram_max: int = Field(3, ge=1, description="Longest suffix n-gram prompt lookup matches.")
    ngram_min: int = Field(1, ge=1, description="Shortest suffix n-gram prompt lookup matches.")
    adaptive: bool = Field(True, description="Choose k per sequence (num_draft_tokens at most, 0: plain decoding) "
                           "from its measured acceptance and the measured costs of draft and verification steps "
                           "(core.runtime.speculative_adaptive); off: always num_draft_tokens.")
    probe_interval: int = Field(8, ge=1, description="Plain steps after which a sequence at k = 0 drafts again "
                                "to measure its acceptance (adaptive).")
    max_verify_rows: int | None = Field(
        None, ge=1, description="Most rows (sequences + drafts) a verification step grows to. Default: the "
        "compiled CPU decode plan's batch limit (core.runtime.cpu_plan.MAX_BATCH), whose rows compute exactly as batch-1 "
        "steps do; steps of more rows run other kernels, whose rounding can change a near-tie greedy token in bf16.")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "draft" and not self.draft_engine_dir:
            raise ValueError("method draft needs draft_engine_dir (--draft_engine_dir)")
        if self.method == "ngram" and self.draft_engine_dir:
            raise ValueError("draft_engine_dir is for method draft, not ngram")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} is larger than ngram_max {self.ngram_max}")
        return self


def speculative_config(value: SpeculativeConfig | dict | None,
                       label=lambda field: f"speculative {field}".strip()) -> SpeculativeConfig | None:
    """`LLM(speculative=...)`: a SpeculativeConfig, its fields as a dict, or None (off). A bad
    field is a one-line BestiaryError starting with label(field name) (the CLI: its flag)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    try:
        return SpeculativeConfig(**value)
    except ValidationError as err:
        first = err.errors()[0]
        field, msg = ".".join(str(p) for p in first["loc"]), first["msg"]
    except ValueError as err:
        field, msg = "", str(err)
    raise BestiaryError(f"{label(field)}: {msg.removeprefix('Value error, ')}") from None
