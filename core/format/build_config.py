"""The engine's build configuration (limits), shared by `bestiary build` and the runtime.

Light on purpose (no torch): the CLI builds its `build` flags from this schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from bestiary.core.format.config import StrictModel
from bestiary.core.format.errors import BestiaryError, ConfigError

FORMAT_VERSION = 1
INT32_MAX = 2**31 - 1  # every limit and the KV pool's tokens are 32-bit counts (TensorRT-LLM's SizeType32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class BuildConfig(StrictModel):
    """Engine limits (trtllm-build names). Every field is a `bestiary build --flag`."""

    max_batch_size: int = Field(8, ge=1, le=INT32_MAX, description="Most sequences decoded in one step.")
    max_input_len: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Longest prompt, in tokens (default: min(1024, max_seq_len - 1)).")
    max_seq_len: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Longest prompt + output, at least 2 (default: the model's max "
                                              "positions).")
    max_num_tokens: int = Field(4096, ge=1, le=INT32_MAX, description="Most tokens (prefill + decode) in one step.")
    tokens_per_block: int = Field(32, ge=1, le=INT32_MAX, description="Tokens per paged KV cache block, 1 to 1024 "
                                                                      "(the pool is allocated in whole blocks).")
    max_tokens_in_paged_kv_cache: int | None = Field(
        None, ge=1, le=INT32_MAX, description="KV pool size in tokens (default: max_batch_size * max_seq_len)."
    )
    max_attention_window: int | None = Field(
        None, ge=1, le=INT32_MAX, description="Every query attends to at most this many recent keys (sinks "
                                              "included), in every layer; blocks past it are released (default: "
                                              "the model's own windows, else all).")
    sink_token_length: int = Field(
        0, ge=0, le=INT32_MAX, description="The first tokens of a sequence every windowed query keeps attending to "
                                           "(attention sinks); must be smaller than the window.")


MIN_SEQ_LEN = 2  # one prompt token and one generated token: max_input_len = max_seq_len - 1 >= 1
MAX_TOKENS_PER_BLOCK = 1024  # far above any useful block (vLLM and TensorRT-LLM use 16 to 128)
DEFAULT_MAX_POSITIONS = 2048  # max_seq_len of a model whose config has no max_position_embeddings


def _model_positions(model_config: dict[str, Any], source: str) -> int:
    """The model's max_position_embeddings (DEFAULT_MAX_POSITIONS when null): an integer, not a bool."""
    value = model_config.get("max_position_embeddings")
    if value is None:
        return DEFAULT_MAX_POSITIONS
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 2048.0: what pydantic's validation of the same field accepts
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # true is not 1 position
        raise ConfigError(f"{source}: field 'max_position_embeddings': expected a positive integer "
                          f"(got {value!r})")
    return value


def _check_seq_len(max_seq: int, max_pos: int, given: bool, where: str) -> None:
    """max_seq_len within [MIN_SEQ_LEN, the model's positions]; one line naming the flag otherwise."""
    if max_seq > max_pos:
        raise BestiaryError(f"{where}--max_seq_len {max_seq}: exceeds the model's max_position_embeddings {max_pos}")
    if max_seq < MIN_SEQ_LEN:
        what = f"--max_seq_len {max_seq}" if given else f"max_seq_len {max_seq} (the model's max_position_embeddings)"
        raise BestiaryError(f"{where}{what}: expected at least {MIN_SEQ_LEN} (one prompt token and one generated "
                            "token); an engine of fewer cannot run")


def _check_blocks(build: BuildConfig, where: str) -> None:
    """tokens_per_block within [1, MAX_TOKENS_PER_BLOCK]: the pool is allocated in whole blocks."""
    if not 1 <= build.tokens_per_block <= MAX_TOKENS_PER_BLOCK:
        raise BestiaryError(f"{where}--tokens_per_block {build.tokens_per_block}: expected 1 to "
                            f"{MAX_TOKENS_PER_BLOCK} tokens per block (the KV pool is allocated in whole blocks)")


def _check_window(build: BuildConfig, model_config: dict[str, Any], where: str) -> None:
    """Attention sinks need a window larger than them."""
    window, sinks = build.max_attention_window, build.sink_token_length
    if sinks and window is not None and sinks >= window:
        raise BestiaryError(f"{where}--sink_token_length {sinks}: must be smaller than --max_attention_window {window}")
    if sinks and window is None and not model_config.get("sliding_window"):
        raise BestiaryError(f"{where}--sink_token_length {sinks}: needs --max_attention_window (the model has no "
                            "sliding_window)")


def _check_pool(build: BuildConfig, max_seq: int, where: str) -> None:
    """The KV pool, in whole blocks, within INT32_MAX tokens: a larger one is a mistake in the flags, not
    a size some host could hold (a pool within it that this host cannot hold: core.convert.memory)."""
    given = build.max_tokens_in_paged_kv_cache
    tokens = given or build.max_batch_size * max_seq
    pooled = -(-tokens // build.tokens_per_block) * build.tokens_per_block
    if pooled > INT32_MAX:
        seq = f"--max_seq_len {max_seq:,}" if build.max_seq_len else f"max_seq_len {max_seq:,} (the model's positions)"
        what = (f"--max_tokens_in_paged_kv_cache {given:,}" if given else
                f"--max_batch_size {build.max_batch_size:,} * {seq}")
        raise BestiaryError(f"{where}{what}: a KV pool of {pooled:,} tokens, more than the {INT32_MAX:,} an engine "
                            "counts (32-bit); lower it")


def finalize_build_config(build: BuildConfig, model_config: dict[str, Any], source: str = "config.json",
                          at_load: bool = False) -> BuildConfig:
    """Fill defaults that depend on the model and check the limits agree and are ones run can use.

    `source`: the config.json `model_config` was read from; `at_load`: an engine's limits are being
    loaded (an error then names the engine's config.json and the flag it was built with). Every error
    is one line naming the flag, the value and what is expected."""
    where = f"{source}: built with " if at_load else ""
    max_pos = _model_positions(model_config, source)
    max_seq = build.max_seq_len or max_pos
    _check_seq_len(max_seq, max_pos, build.max_seq_len is not None, where)
    _check_blocks(build, where)
    _check_pool(build, max_seq, where)
    _check_window(build, model_config, where)
    max_input = build.max_input_len or min(1024, max_seq - 1)
    if max_input >= max_seq:
        raise BestiaryError(f"{where}--max_input_len {max_input}: must be smaller than --max_seq_len {max_seq}")
    return build.model_copy(update={"max_seq_len": max_seq, "max_input_len": max_input})


def pool_blocks(build: BuildConfig) -> tuple[int, int]:
    """(blocks, tokens) of the KV pool a finalized build asks for, as run allocates it: the pool's
    tokens (max_tokens_in_paged_kv_cache, else max_batch_size * max_seq_len) rounded up to whole blocks."""
    assert build.max_seq_len is not None, "finalize_build_config sets max_seq_len"
    tokens = build.max_tokens_in_paged_kv_cache or build.max_batch_size * build.max_seq_len
    blocks = -(-tokens // build.tokens_per_block)
    return blocks, blocks * build.tokens_per_block
