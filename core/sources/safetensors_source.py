"""Weights from .safetensors files, read lazily through `safe_open(...).get_slice`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bestiary.core.format.errors import WeightsError
from bestiary.core.sources.base import slice_dim


class SafetensorsWeights:
    """WeightSource over one or more .safetensors files (memory-mapped, sliced on read)."""

    def __init__(self, files: list[Path]) -> None:
        self._handles: dict[Path, safe_open] = {}
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise WeightsError(f"{f}: not a readable .safetensors file ({err})") from None
            self._handles[f] = handle
            for key in handle.keys():  # type: ignore[no-untyped-call]  # safetensors' stub leaves keys() unannotated
                self._where[key] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, key: str) -> str:
        return str(self._where[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        part = self._slice(key)
        index = slice_dim(tuple(part.get_shape()), tp_size, tp_dim, tp_rank)
        try:
            tensor: torch.Tensor = part[index] if index else part[:]
            return tensor
        except Exception as err:  # noqa: BLE001
            raise WeightsError(f"{self._where[key]}: cannot read tensor {key!r} ({err})") from None

    def _slice(self, key: str) -> Any:
        """safetensors' lazy slice of `key` (`get_shape()`, and indexing reads the tensor)."""
        return self._handles[self._where[key]].get_slice(key)  # type: ignore[no-untyped-call]  # unannotated stub
