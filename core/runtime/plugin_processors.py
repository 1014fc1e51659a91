"""Logits processors registered by plugins, applied per request (docs/logits-processors.md).

A request names them, in order: `SamplingConfig.logits_processors = [{"name": NAME, "args": {...}}]`
(or just "NAME"). When it is added, the executor looks each name up in the registry the LLM was loaded
with (`bestiary_register_logits_processors`) and calls `factory(args, context)` once per sequence,
so a processor may keep state. Every step the chooser (core.runtime.sampling.TokenChooser) computes

    x = penalties(logits)                        (core.runtime.logits_processors, built in)
    x = p_k(ids, ... p_2(ids, p_1(ids, x.clone())))   ids = prompt + output so far, x [V] float32
    x = grammar_mask(x)                          (guided requests, core.runtime.guided)

then temperature, top-k / top-p and the draw. An unknown name, args a factory refuses (ValueError,
TypeError, KeyError), a processor that raises or returns anything but a [V] tensor: one-line
BestiaryError naming the processor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from bestiary.core.runtime.tokenizer import Tokenizer
    from bestiary.registry import Registry

Processor = Callable[[list[int], torch.Tensor], torch.Tensor]


class ProcessorRequest(BaseModel):
    """One processor a request asks for: its registered name and the JSON object its factory takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=100, description="A name registered by a plugin.")
    args: dict[str, Any] = Field(default_factory=dict, description="Passed to the processor's factory.")

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, value: Any) -> Any:
        """"ban_digits" is {"name": "ban_digits"}."""
        return {"name": value} if isinstance(value, str) else value


@dataclass
class ProcessorContext:
    """What a factory may use besides its args: the engine's vocabulary and tokenizer."""

    vocab_size: int
    tokenizer: Tokenizer | None = None
    _strings: list[str] | None = field(default=None, repr=False)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokenizer's end ids (none without a tokenizer)."""
        return frozenset(self.tokenizer.stop_ids) if self.tokenizer is not None else frozenset()

    def token_strings(self) -> list[str]:
        """Each id's vocabulary string ('' where the tokenizer has none, or none at all), [V]; built once."""
        if self._strings is None:
            strings = self.tokenizer.token_strs(list(range(self.vocab_size))) if self.tokenizer else []
            self._strings = strings + [""] * (self.vocab_size - len(strings))
        return self._strings


class PluginProcessors:
    """One sequence's processors with the ids it has so far; `push` each chosen token."""

    def __init__(self, named: list[tuple[str, Processor]], prompt: list[int], vocab_size: int) -> None:
        self.named = named
        self.tokens = list(prompt)  # prompt + output
        self.vocab_size = vocab_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Every processor, in order, on a copy of x [V] float32."""
        x = x.clone()
        for name, processor in self.named:
            try:
                out = processor(list(self.tokens), x)
            except Exception as err:  # noqa: BLE001 - a plugin's failure ends as one line naming it
                raise BestiaryError(f"logits processor {name!r} failed: {type(err).__name__}: "
                                    f"{' '.join(str(err).split())[:200]}") from None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (self.vocab_size,):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise BestiaryError(f"logits processor {name!r} returned {got}; expected a tensor of shape "
                                    f"({self.vocab_size},)")
            x = out.to(device=x.device, dtype=torch.float32)
        return x

    def push(self, token: int) -> None:
        self.tokens.append(token)


class ProcessorResolver:
    """Builds a request's processors from the registry's factories (one resolver per LLM; registry None:
    the default one, every installed plugin)."""

    def __init__(self, registry: Registry | None, context: ProcessorContext) -> None:
        self._registry = registry
        self.context = context

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            from bestiary.registry import default_registry

            self._registry = default_registry()
        return self._registry

    def build(self, requests: list[ProcessorRequest], prompt: list[int]) -> PluginProcessors:
        """The processors of one sequence starting with `prompt`; a one-line BestiaryError names a bad one."""
        named: list[tuple[str, Processor]] = []
        for req in requests:
            factory = self.registry.logits_processor(req.name).factory
            try:
                processor = factory(dict(req.args), self.context)
            except (ValueError, TypeError, KeyError) as err:
                raise BestiaryError(f"logits_processors: {req.name!r} args {_shown(req.args)}: "
                                    f"{' '.join(str(err).split())[:200]}") from None
            if not callable(processor):
                raise BestiaryError(f"logits_processors: {req.name!r}: its factory returned {type(processor).__name__}, "
                                    "not a processor (a callable)")
            named.append((req.name, processor))
        return PluginProcessors(named, prompt, self.context.vocab_size)


def _shown(args: dict[str, Any]) -> str:
    text = repr(args)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.lru_cache(maxsize=4)
def _default_resolver(vocab_size: int) -> ProcessorResolver:
    return ProcessorResolver(None, ProcessorContext(vocab_size))


def resolver_for(resolver: ProcessorResolver | None, vocab_size: int) -> ProcessorResolver:
    """`resolver` (set by LLM: its registry and tokenizer), else the default registry's, without a tokenizer
    (an Executor made by hand)."""
    return resolver if resolver is not None else _default_resolver(vocab_size)
