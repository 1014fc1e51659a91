"""`LoraRequest(name, path)`: which adapter a request runs with; the store loads each one once.

The first request naming an adapter loads it from `path` (checked against the model); later
requests with the same name reuse it, path or not. A name already loaded from another path
is an error: names identify adapters, as TensorRT-LLM's lora_task_id does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.adapter import LoraAdapter, load_adapter


@dataclass(frozen=True)
class LoraRequest:
    """An adapter for a request: `name` identifies it; `path` (an HF PEFT dir) is read on first use."""

    name: str
    path: str | Path | None = None


class LoraStore:
    """The adapters loaded for one model rank, by name."""

    def __init__(self, model, registry=None) -> None:
        self.model, self.registry = model, registry
        self.adapters: dict[str, LoraAdapter] = {}

    def get(self, request: LoraRequest | None) -> LoraAdapter | None:
        """The adapter of `request` (None: the base model), loading it on first use."""
        if request is None:
            return None
        if not isinstance(request, LoraRequest):
            raise BestiaryError(f"lora: expected a LoraRequest or None, got {type(request).__name__}")
        known = self.adapters.get(request.name)
        if known is not None:
            if request.path is not None and Path(request.path).resolve() != known.path.resolve():
                raise BestiaryError(f"LoRA adapter {request.name!r} is already loaded from {known.path}, "
                                    f"not {request.path}: give another name")
            return known
        if request.path is None:
            raise BestiaryError(f"LoRA adapter {request.name!r} is not loaded yet: give its path")
        adapter = load_adapter(request.path, self.model, request.name, self.registry)
        self.adapters[request.name] = adapter
        return adapter
