"""Weights from PyTorch .bin / .pth files (`torch.load(weights_only=True, mmap=True)`)."""

from __future__ import annotations

from pathlib import Path

import torch

from bestiary.core.format.errors import WeightsError
from bestiary.core.sources.base import slice_dim


def _state_dict(obj: object, path: Path) -> dict[str, torch.Tensor]:
    """The tensor dict inside a loaded file (plain state dict, or under "state_dict"/"model")."""
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "module"):
            if key in obj and isinstance(obj[key], dict):
                return _state_dict(obj[key], path)
    raise WeightsError(f"{path}: expected a dict of tensors (a state dict), got {type(obj).__name__}")


class TorchWeights:
    """WeightSource over .bin/.pth files; tensors are memory-mapped where the format allows."""

    def __init__(self, files: list[Path]) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                try:
                    obj = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) format cannot be mmapped
                    obj = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001
                raise WeightsError(f"{f}: not a readable PyTorch weights file ({type(err).__name__}: {err})") from None
            for key, tensor in _state_dict(obj, f).items():
                self._tensors[key] = tensor
                self._where[key] = f

    def keys(self) -> list[str]:
        return list(self._tensors)

    def file_of(self, key: str) -> str:
        return str(self._where[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        tensor = self._tensors[key]
        return tensor[slice_dim(tuple(tensor.shape), tp_size, tp_dim, tp_rank)]
