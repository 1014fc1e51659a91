"""Weights from .safetensors files, read lazily through `safe_open(...).get_slice`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from bestiary.core.format.errors import WeightsError
from bestiary.core.sources.base import slice_dim


class SafetensorsWeights:
    """WeightSource over one or more .safetensors files (memory-mapped, sliced on read)."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = {}
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise WeightsError(f"{f}: not a readable .safetensors file ({err})") from None
            self._handles[f] = handle
            for key in handle.keys():
                self._where[key] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def file_of(self, key: str) -> str:
        return str(self._where[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[key]].get_slice(key).get_shape())

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        part = self._handles[self._where[key]].get_slice(key)
        index = slice_dim(tuple(part.get_shape()), tp_size, tp_dim, tp_rank)
        try:
            return part[index] if index else part[:]
        except Exception as err:  # noqa: BLE001
            raise WeightsError(f"{self._where[key]}: cannot read tensor {key!r} ({err})") from None
