"""The interface every weight source implements (HF dir, .safetensors, .bin/.pth, GGUF).

A *source* is what `bestiary convert` reads: tensors under their source names, an
HF-style config dict, and optionally a tokenizer. Everything downstream (key maps,
postprocess hooks, the checkpoint writer) sees only this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


def slice_dim(shape: tuple[int, ...], tp_size: int, tp_dim: int, tp_rank: int) -> tuple[slice, ...]:
    """Index tuple selecting rank `tp_rank`'s contiguous 1/tp_size part of `shape` along `tp_dim`.

    tp_dim < 0 or tp_size == 1 selects everything. The dim must divide evenly.
    """
    full = tuple(slice(None) for _ in shape)
    if tp_size == 1 or tp_dim < 0:
        return full
    size = shape[tp_dim]
    if size % tp_size:
        raise ValueError(f"dim {tp_dim} of shape {tuple(shape)} is not divisible by tp_size {tp_size}")
    part = size // tp_size
    index = list(full)
    index[tp_dim] = slice(tp_rank * part, (tp_rank + 1) * part)
    return tuple(index)


class WeightSource(Protocol):
    """Tensors of a source checkpoint, read lazily, by source key."""

    def keys(self) -> list[str]:
        """All tensor keys, in the source's own naming."""

    def shape(self, key: str) -> tuple[int, ...]:
        """Full (unsliced) shape of `key`, as `load` would return it."""

    def file_of(self, key: str) -> str:
        """Path of the file holding `key` (for error messages)."""

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        """Rank `tp_rank`'s slice of `key` along `tp_dim` (whole tensor when tp_size == 1)."""


@dataclass
class TokenizerFiles:
    """What a source knows about its tokenizer, in HF's on-disk form.

    tokenizer_json: the text of a `tokenizers` tokenizer.json.
    tokenizer_config: dict in the shape of HF's tokenizer_config.json; bestiary reads
      bos_token, eos_token, pad_token, unk_token, add_bos_token, add_eos_token, chat_template.
    """

    tokenizer_json: str
    tokenizer_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelSource:
    """A source opened by `open_source`: weights + HF-style config (+ tokenizer)."""

    path: Path
    format: str  # "hf_dir" | "safetensors" | "torch" | "gguf" | "flm"
    weights: WeightSource
    hf_config: dict[str, Any]
    tokenizer: TokenizerFiles | None = None
