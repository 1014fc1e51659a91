"""Hook specifications of bestiary's plugin system (pluggy project name "bestiary").

An architecture package exposes a module (named in the `bestiary.architectures`
entry-point group) with functions decorated by `bestiary.plugins.hookimpl`.
Built-in architectures use exactly this API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "bestiary"
ENTRY_POINT_GROUP = "bestiary.architectures"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def bestiary_register_architectures(register: Callable[[Any], None]) -> None:
    """Register architectures: call `register(spec)` once per `ArchitectureSpec`.

    (Typed `Any` here: ArchitectureSpec lives a layer above, in bestiary.registry; `register`
    checks it at run time and raises TypeError for anything else.)

    The registry raises on a duplicate name, naming both packages.
    """


@hookspec
def bestiary_claim_hf_config(hf_config: dict[str, Any]) -> str | None:
    """Return the architecture name that handles this HF config.json dict, or None.

    Used when the HF architecture name / model_type is ambiguous (e.g. ChatGLM v1 and
    v2 both say "ChatGLMModel"). Two plugins claiming one config is an error naming both.
    """


@hookspec
def bestiary_register_logits_processors(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register named logits processors: call `register(name, factory)` once per processor.

    A request names the processors it wants, in order (`SamplingConfig.logits_processors =
    [{"name": NAME, "args": {...}}]`, the server's `logits_processors` field); for each one the
    runtime calls, once per sequence when the request is added,

        factory(args: dict, context) -> processor
        processor(token_ids: list[int], logits: Tensor [V] float32) -> Tensor [V]

    `args` is the request's JSON object (default {}); a bad one should raise ValueError / TypeError /
    KeyError, which refuses the request with one line naming the processor. `context`
    (bestiary.core.runtime.plugin_processors.ProcessorContext) holds `vocab_size`, the engine's
    `tokenizer` (None for an engine without one), its `stop_ids` and `token_strings()` (every id's
    vocabulary string), so a processor can map text to ids. Each step the processor receives the
    sequence's ids so far (prompt + output) and its logits after the built-in penalties and before
    the grammar mask and temperature (a copy it may change in place, on the model's device), and
    returns new logits of the same shape (-inf bans a token).

    `name`: letters, digits and `_ . : -`; a name registered twice is the second plugin's failure.
    """


@hookspec
def bestiary_register_grammar_backends(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register named grammar backends for structured output: call `register(name, factory)` once per backend.

    A request picks one with `GuidedConfig(backend=NAME, ...)` (the server's `guided_decoding_backend`
    field; default "llguidance", the built-in). For each engine, at the first request naming it, the
    runtime calls

        factory(tokenizer_json: str, vocab_size: int, stop_ids: set[int]) -> compiler

    and uses the compiler as bestiary.core.runtime.guided.GrammarCompiler: `check(config)` raises
    BestiaryError (one line) for a constraint it refuses, when the request is made; `matcher(config)`
    returns one sequence's matcher with GrammarMatcher's interface: `words` (int32 words of a mask row,
    ceil(vocab_size / 32)), `fill(mask [N, words] int32, row)` (bit t % 32 of word t // 32 set where
    token t may come next; an end id only where the constraint is complete), `accept(token) -> bool`,
    `take(token)` (accept, raising on a refusal), `valid_prefix(tokens) -> int`, `rollback(count)`,
    `stopped` (complete: nothing more may follow) and `error` (str or None). A backend may support only
    some of GuidedConfig's kinds and refuse the others in `check`.

    `name`: letters, digits and `_ . : -`; "llguidance" is the built-in's; a name registered twice is the
    second plugin's failure.
    """
