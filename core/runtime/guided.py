"""Structured output: a request's tokens held to a JSON schema, a regular expression, a grammar or a choice.

`SamplingConfig.guided = GuidedConfig(...)` names one constraint. The engine's `GrammarCompiler`
(llguidance over the engine's own tokenizer.json; docs/structured-output.md says why llguidance)
compiles it once (cached by its text) and gives each sequence a `GrammarMatcher`. Every step, for
every guided row, the matcher fills a bitmask m [W = ceil(V / 32)] int32 (bit t of word t // 32 is 1
when token t may come next), while the forward runs (`MaskFill`); the chooser then sets

    x_t = -inf  where bit t of m is 0          (after penalties, before temperature / top-k / top-p)

so greedy and sampling pick only tokens the grammar allows. An end id is allowed exactly where the
grammar accepts; a matcher that has reached its grammar's end ("stopped") ends the request with
"stop"; max_new_tokens inside an unfinished structure ends it with "length", as any request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bestiary.core.format.errors import BestiaryError

GRAMMAR_CACHE = 64  # compiled grammars kept per engine (a server's requests often repeat a schema)
BUILT_IN = "llguidance"
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class GuidedConfig(BaseModel):
    """One constraint on a request's output: exactly one of the five kinds."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | bool | None = Field(
        None, description="A JSON Schema (a dict): the output is one JSON value that validates against it.")
    json_object: bool = Field(False, description="The output is one JSON object (any keys and values).")
    regex: str | None = Field(None, description="The output fully matches this regular expression (Rust regex "
                                                "syntax, as Python's re for common patterns; no lookaround).")
    grammar: str | None = Field(None, description="A grammar: Lark (llguidance's dialect, start rule `start`) "
                                                  "or GBNF (llama.cpp's, start rule `root`: a text with `::=` "
                                                  "and no `start:` rule).")
    choice: list[str] | None = Field(None, min_length=1, description="The output is exactly one of these strings.")
    backend: str = Field(BUILT_IN, min_length=1, max_length=100,
                         description="The grammar backend: 'llguidance' (built in) or one a plugin registers "
                                     "(hook bestiary_register_grammar_backends).")
    json_whitespace: Literal["single", "flexible"] = Field(
        "single", description="JSON layout: 'single' writes `, ` and `: ` and no other whitespace (small models "
                              "cannot loop on newlines); 'flexible' allows any JSON whitespace.")

    @model_validator(mode="after")
    def _one_kind(self) -> GuidedConfig:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)} (given: {', '.join(given) or 'none'})")
        if self.choice is not None and any(not c for c in self.choice):
            raise ValueError("choice: empty string")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


    def key(self) -> str:
        """The cache key: the kind and its text (schemas in canonical JSON)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def lark_of(config: GuidedConfig) -> str:
    """The llguidance grammar (its JSON form) of a constraint; a ValueError names what is wrong."""
    import llguidance

    kind = config.kind
    if kind in ("json_schema", "json_object"):
        schema = config.json_schema if kind == "json_schema" else {"type": "object"}
        options: dict[str, Any] = {"whitespace_flexible": config.json_whitespace == "flexible"}
        if config.json_whitespace == "single":
            options.update(item_separator=", ", key_separator=": ")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(str(config.regex))
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in config.choice or [])
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    text = str(config.grammar)
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if "::=" in text and not is_lark_syntax(text):  # GBNF (llama.cpp): root ::= ...; Lark has a `start:` rule

        try:
            text = gbnf_to_lark(text)
        except Exception as err:  # noqa: BLE001 - the converter raises its parser's own exception types
            raise ValueError(f"not a GBNF grammar: {_first_line(err)}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [N, W] int32 -> allowed [N, V] bool: allowed[n, t] = bit (t % 32) of mask[n, t // 32]."""
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    bits = (mask[:, :, None] >> shifts) & 1  # [N, W, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [N, V] float with -inf where mask [N, W] forbids the token."""
    allowed = unpack_bitmask(mask, x.shape[-1]).to(x.device)
    return x.masked_fill(~allowed, float("-inf"))


class GrammarMatcher:
    """One sequence's position in its grammar: fill the next-token mask, accept tokens, roll back."""

    def __init__(self, matcher: Any, kind: str, words: int) -> None:
        self._m = matcher  # an llguidance.LLMatcher
        self.kind = kind
        self.words = words  # W: int32 words of a mask row

    def fill(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into mask[row] ([N, W] int32, CPU, contiguous). (Not through
        llguidance.torch: importing it compiles a torch function, seconds of start-up.)"""
        assert mask.dtype == torch.int32 and mask.is_cpu and mask.is_contiguous() and mask.shape[1] == self.words
        target = mask[row]
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False (and the matcher stays in error) if the grammar forbids it."""
        return bool(self._m.consume_token(token))

    def take(self, token: int) -> None:
        """Advance by a token the mask allowed; a refusal is a bug (the output would not match), raised."""
        if not self.accept(token):
            raise RuntimeError(f"grammar matcher refused token {token} its mask allowed ({self.error})")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from here (the state does not change)."""
        return int(self._m.validate_tokens(tokens))

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens (a speculative draft's rejected tail)."""
        if count and not self._m.rollback(count):
            raise RuntimeError(f"grammar matcher: cannot roll back {count} tokens ({self._m.get_error()})")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow (only an end id would)."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None


class GrammarCompiler:
    """Compiles constraints for one engine's tokenizer (built lazily, once) and caches the results."""

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int, stop_ids: set[int]) -> None:
        self._json = tokenizer_json  # the tokenizer.json text, or what gives it (read at the first constraint)
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> template LLMatcher
        self._lock = threading.Lock()  # the server's handlers compile while the executor's thread steps

    @property
    def mask_words(self) -> int:
        """W: int32 words of one bitmask row."""
        return (self.vocab_size + 31) // 32

    def _llg_tokenizer(self) -> Any:
        import llguidance

        if self._tokenizer is None:
            eos = self.stop_ids or None
            try:
                text = self._json() if callable(self._json) else self._json
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
            except Exception as err:  # noqa: BLE001 - tokenizers / llguidance raise their own types
                raise BestiaryError(f"structured output: the grammar compiler cannot read this engine's tokenizer "
                                    f"({_first_line(err)})") from None
        return self._tokenizer

    def check(self, config: GuidedConfig) -> None:
        """Compile now (cached), so a bad constraint is refused when the request is made, not mid-batch."""
        self._template(config)

    def matcher(self, config: GuidedConfig) -> GrammarMatcher:
        """A fresh matcher at the start of `config`'s grammar."""
        return GrammarMatcher(self._template(config).deep_copy(), config.kind, self.mask_words)

    def _template(self, config: GuidedConfig) -> Any:
        import llguidance

        key = config.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                grammar = lark_of(config)
            except ValueError as err:
                raise BestiaryError(f"guided {config.kind}: {_first_line(err)}") from None
            template = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
            if template.is_error():
                raise BestiaryError(f"guided {config.kind}: {_first_line(template.get_error())}")
            self._cache[key] = template
            while len(self._cache) > GRAMMAR_CACHE:
                self._cache.popitem(last=False)
            return template


def _first_line(message: object) -> str:
    """An error of several lines (a regex parser's caret diagram) as one line, at most 300 characters."""
    return " ".join(str(message).split())[:300] or "invalid"


class MaskFill:
    """Bitmasks of a step's guided rows, filled on a helper thread while the forward runs.

    start(rows) copies nothing: the matchers are only read until `wait`, and the executor advances
    them after it. llguidance computes masks with the GIL released, so the fill overlaps the model.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, matchers: list[GrammarMatcher]) -> Future[torch.Tensor]:
        """Masks [len(matchers), W] int32 (row i: matchers[i]) as a future."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bestiary-grammar")
        return self._pool.submit(fill_masks, matchers)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def fill_masks(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """The next-token masks of `matchers`, [N, W] int32 (row i: matchers[i])."""
    mask = torch.full((len(matchers), matchers[0].words if matchers else 0), -1, dtype=torch.int32)  # [N, W]
    for row, matcher in enumerate(matchers):
        matcher.fill(mask, row)
    return mask


class GrammarBackends:
    """An engine's grammar compilers by backend name: the built-in llguidance one, and those plugins register
    (made at the first request naming them, from the registry's factory: plugins/hookspecs.py)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, stop_ids: set[int], registry: Any) -> None:
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self.stop_ids = set(stop_ids)
        self.registry = registry  # the bestiary.registry.Registry the LLM was loaded with (None: the default)
        self._compilers: dict[str, Any] = {BUILT_IN: GrammarCompiler(tokenizer_json, vocab_size, stop_ids)}
        self._lock = threading.Lock()

    def compiler(self, name: str) -> Any:
        """The compiler of backend `name`; an unknown name is a one-line BestiaryError listing the known ones."""
        with self._lock:
            if name not in self._compilers:
                if self.registry is None:  # the registry the engine was loaded with: the default one
                    from bestiary.registry import default_registry

                    self.registry = default_registry()
                named = self.registry.grammar_backend(name)
                try:
                    self._compilers[name] = named.factory(self._json(), self.vocab_size, set(self.stop_ids))
                except BestiaryError:
                    raise
                except Exception as err:  # noqa: BLE001 - a plugin's failure, named
                    raise BestiaryError(f"guided backend {name!r} (from {named.package}): {_first_line(err)}") from None
            return self._compilers[name]

    def check(self, config: GuidedConfig) -> None:
        """Compile `config` with its backend now (a refusal is one line)."""
        self.compiler(config.backend).check(config)

    def matcher(self, config: GuidedConfig) -> GrammarMatcher:
        """A fresh matcher of `config` from its backend."""
        return self.compiler(config.backend).matcher(config)
