"""Ground truths the conformance kit compares an architecture with.

A reference writes a tiny random source directory (what `bestiary convert` reads) and computes
logits [T, V] (float32) for a token sequence from the same weights:

    HFReference(config)              a transformers model built from `config` (an HF config object,
                                     or a dict with `model_type` for AutoConfig.for_model), weights
                                     re-drawn by parity.reinit_ so a wrong layout shows
    FunctionReference(write, logits) families transformers lacks: `write(directory)` saves the
                                     source and returns its weights, `logits(weights, ids)` is the
                                     family's forward in plain torch
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from bestiary.testing.parity import hf_logits, reinit_

if TYPE_CHECKING:
    import transformers


class Reference(Protocol):
    """What the conformance suite compares an architecture with."""

    def save(self, directory: Path) -> Path:
        """Write the source directory `bestiary convert` reads; returns it."""
        ...

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), V] (float32) of one token sequence, from the saved weights."""
        ...


def hf_config_object(config: Any) -> transformers.PretrainedConfig:
    """An HF config object from an object or a dict with `model_type`."""
    if not isinstance(config, dict):
        return cast("transformers.PretrainedConfig", config)  # an HF config object, as conformance() documents
    import transformers

    fields = dict(config)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


@dataclass
class HFReference:
    """A tiny transformers model of `config` with seeded random weights."""

    config: Any
    seed: int = 0
    _model: transformers.PreTrainedModel | None = field(default=None, repr=False)

    @property
    def model(self) -> transformers.PreTrainedModel:
        """The model, built on first use (seeded; weights re-drawn by parity.reinit_)."""
        if self._model is None:
            import transformers

            torch.manual_seed(self.seed)
            config = hf_config_object(self.config)
            # transformers leaves from_config unannotated
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
            self._model = reinit_(model.float(), self.seed)
        return self._model

    def save(self, directory: Path) -> Path:
        """save_pretrained into `directory` (safetensors + config.json)."""
        self.model.save_pretrained(directory)
        return directory

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float32."""
        return hf_logits(self.model, ids)


@dataclass
class FunctionReference:
    """A family without a transformers class: a source writer and a plain-torch forward."""

    write: Callable[[Path], Any]  # directory -> the weights `logits` reads (e.g. a dict of tensors)
    forward: Callable[[Any, list[int]], torch.Tensor]  # (weights, ids) -> logits [T, V]
    _weights: Any = field(default=None, repr=False)

    def save(self, directory: Path) -> Path:
        """Run `write` on `directory` (created) and keep the weights it returns."""
        directory.mkdir(parents=True, exist_ok=True)
        self._weights = self.write(directory)
        return directory

    def logits(self, ids: list[int]) -> torch.Tensor:
        """`forward` of the saved weights, float32 [len(ids), V]."""
        if self._weights is None:
            raise RuntimeError("FunctionReference.logits before save(): no weights yet")
        with torch.no_grad():
            return self.forward(self._weights, ids).float()


def as_reference(case: Any) -> Reference:
    """A reference from what `conformance()` was given: a reference, an HF config object or dict."""
    return case if hasattr(case, "save") and hasattr(case, "logits") else HFReference(case)
