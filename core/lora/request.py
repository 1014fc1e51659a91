"""`LoraRequest`: which adapter a request runs with, and the weights its first request brings.

A request names its adapter by `name` (TensorRT-LLM's lora_task_id: a string or an integer,
compared as text). The first request of a name brings the weights, as an HF PEFT dir (`path`)
or as TensorRT-LLM's LoRA tensors (`weights` [num_module_layers, D*Hi + Ho*D] and `config`
[num_module_layers, 3], numpy or torch: core.lora.trtllm_tensors); later requests may give the
name alone while the adapter is cached (core.lora.cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoraRequest:
    """An adapter for a request: `name` (the task id) identifies it; `path` or `weights` + `config` bring it."""

    name: str | int
    path: str | Path | None = None
    weights: Any = field(default=None, compare=False, repr=False)
    config: Any = field(default=None, compare=False, repr=False)

    @property
    def task_id(self) -> str:
        """The cache key: `name` as text."""
        return str(self.name)

    @property
    def brings_weights(self) -> bool:
        return self.path is not None or self.weights is not None or self.config is not None
