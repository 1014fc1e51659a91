"""The settings of one `bestiary bench` run (the CLI's flags are these fields)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

WORKLOADS = ("decode", "prefill", "mixed")  # the default workloads
ALL_WORKLOADS = (*WORKLOADS, "rewrite")  # rewrite: input-grounded, needs a tokenizer (core.bench.rewrite)


class BenchConfig(BaseModel):
    """What to measure and how often; every system in the run gets the same settings."""

    model_config = ConfigDict(extra="forbid")

    workloads: list[str] = Field(list(WORKLOADS), description="Which of decode, prefill, mixed, rewrite to run.")
    new_tokens: int = Field(64, ge=1, description="Decode: new tokens per timed generation (greedy, EOS ignored); "
                            "rewrite: at most this many (it stops at EOS).")
    repeats: int = Field(3, ge=1, description="Decode, prefill and rewrite: timed repeats; the median is reported.")
    rounds: int = Field(1, ge=1, description="Every system measured this many times, in turn (each opened anew "
                        "per round); per system and figure the median round is reported, so a slow phase of a "
                        "shared machine falls on every system alike.")
    decode_prompt_len: int = Field(16, ge=1, description="Decode: prompt tokens before the timed tokens.")
    prompt_lens: list[int] = Field([128, 512, 2048], description="Prefill: prompt lengths whose TTFT is measured.")
    mixed_requests: int = Field(64, ge=1, description="Mixed: requests, all submitted at once.")
    mixed_prompt_lens: tuple[int, int] = Field((16, 384), description="Mixed: prompt length range (inclusive).")
    mixed_output_lens: tuple[int, int] = Field((16, 128), description="Mixed: output length range (inclusive).")
    rewrite_texts: int = Field(3, ge=1, description="Rewrite: passages of the built-in text, one request each.")
    rewrite_text_tokens: int = Field(300, ge=1, description="Rewrite: tokens per passage (cut at the line end "
                                     "that reaches it).")
    static_batch: int = Field(16, ge=1, description="Mixed on peers without in-flight batching: static batch size.")
    seed: int = Field(0, description="Seed of the synthetic prompts (token ids) and lengths.")
    bandwidth_mib: int = Field(1024, ge=0, description="MiB summed to measure the read bandwidth (0: not measured).")

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        unknown = [w for w in self.workloads if w not in ALL_WORKLOADS]
        if unknown:
            raise ValueError(f"unknown workload {unknown[0]!r}: expected one of {', '.join(ALL_WORKLOADS)}")
        for name in ("mixed_prompt_lens", "mixed_output_lens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} {lo}..{hi}: expected 1 <= low <= high")
        if any(n < 1 for n in self.prompt_lens):
            raise ValueError(f"prompt_lens {self.prompt_lens}: expected positive lengths")
        return self
