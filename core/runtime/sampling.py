"""Sampling parameters and the token chooser.

Semantics (docs/sampling.md has the full table): temperature 0 or top_k == 1 is greedy;
top_k == 0 and top_p == 1.0 are off. Otherwise logits / temperature are filtered to the
top_k largest, then to the smallest set whose probability mass reaches top_p,
renormalised and sampled with the request's own generator (seeded by random_seed, so a
seed reproduces a run). Penalties, bans and the embedding bias (core.runtime.logits_processors)
act on the logits before temperature. beam_width > 1 is beam search (core.runtime.beam).

Plain requests (no penalty, no ban, no extra output) take `sample`, a batched fast path;
every other request gets a `TokenChooser` holding its per-step state.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.sampling_ref import filter_logits
from bestiary.core.runtime.guided import GrammarMatcher, GuidedConfig, apply_bitmask
from bestiary.core.runtime.logits_processors import LogitsPipeline, ProcessorState
from bestiary.core.runtime.plugin_processors import PluginProcessors, ProcessorRequest

WordList = list[list[int] | str]
# The smallest temperature that samples: logits / T stay finite in float32 for any |logit| < 3e33. vLLM
# samples greedily below this (its _SAMPLING_EPS); HF takes any T > 0 and gives NaN for a subnormal one.
MIN_TEMPERATURE = 1e-5


class SamplingConfig(BaseModel):
    """Per-request generation parameters (the GPT runtime's SamplingConfig and generation inputs)."""

    model_config = ConfigDict(extra="forbid")

    # --- length and stopping
    max_new_tokens: int = Field(64, ge=1, description="Tokens to generate at most.")
    min_length: int = Field(0, ge=0, description="Generated tokens before an end id (or stop word) may end the request.")
    end_id: int | None = Field(None, ge=0, description="Stop token; defaults to the tokenizer's stop ids.")
    pad_id: int | None = Field(None, ge=0, description="Fills padded outputs (pad_outputs); defaults to end_id, else 0.")
    ignore_eos: bool = Field(False, description="Keep generating past the end ids.")
    stop_words: WordList = Field(default_factory=list, description="Sequences that end generation (ids or text).")
    bad_words: WordList = Field(default_factory=list, description="Sequences never generated (ids or text).")
    stop_strings: list[str] = Field(
        default_factory=list, description="Text that ends generation, matched on the decoded output (however it "
                                          "is tokenized) and cut from the returned text; needs a tokenizer.")
    # --- penalties
    repetition_penalty: float = Field(1.0, gt=0.0, description="Prompt + output tokens: x / r if x > 0 else x * r; 1.0 = off.")
    presence_penalty: float = Field(0.0, description="Subtracted once from every token already in the output.")
    frequency_penalty: float = Field(0.0, description="Subtracted per occurrence of a token in the output.")
    embedding_bias: list[float] | dict[int, float] | None = Field(
        None, description="Added to the logits: a full [vocab_size] list, or {token id: bias}.")
    # --- sampling
    temperature: float = Field(1.0, ge=0.0, description=f"0 = greedy; else at least {MIN_TEMPERATURE}.")
    top_k: int = Field(0, ge=0, description="0 = off; 1 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1.0 = off.")
    top_p_decay: float = Field(1.0, gt=0.0, le=1.0, description="top_p *= decay after each token; 1.0 = off.")
    top_p_min: float = Field(1e-6, gt=0.0, le=1.0, description="Lower bound of the decayed top_p.")
    top_p_reset_ids: int | None = Field(None, ge=0, description="Generating this id resets top_p to its start value.")
    random_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Seed of this request's generator "
                                                                             "(a 64-bit integer, as torch takes).")
    n: int = Field(1, ge=1, description="Independent samples of the prompt (sharing its KV blocks); sample i is "
                                        "seeded with random_seed + i.")
    # --- beam search
    beam_width: int = Field(1, ge=1, description="Beams; 1 = no beam search.")
    beam_search_diversity_rate: float = Field(0.0, ge=0.0, description="Rank penalty within a beam's candidates.")
    length_penalty: float = Field(1.0, description="Finished beam score = cum_log_prob / generated_len ** length_penalty.")
    early_stopping: bool | Literal["never"] = Field(
        False, description="Beam search end: True = at beam_width finished; False = heuristic; 'never' = exact.")
    # --- outputs
    output_log_probs: bool = Field(False, description="Return per-token and cumulative log probs.")
    top_log_probs: int = Field(0, ge=0, le=20, description="Also return the k most likely tokens and their log "
                                                           "probs at each step (0 = off).")
    output_context_logits: bool = Field(False, description="Return the logits of every prompt position.")
    output_generation_logits: bool = Field(False, description="Return the raw logits of every generated step.")
    # --- structured output (core.runtime.guided)
    guided: GuidedConfig | None = Field(
        None, description="Hold the output to a JSON schema, any JSON object, a regex, a grammar or a choice of "
                          "strings (docs/structured-output.md); not with beam search.")
    # --- plugins' logits processors (core.runtime.plugin_processors)
    logits_processors: list[ProcessorRequest] = Field(
        default_factory=list, description="Processors registered by plugins, applied in this order after the "
                                          "penalties and before the grammar mask: [{'name': NAME, 'args': {...}}] or "
                                          "NAME (docs/logits-processors.md); not with beam search.")
    # --- attention window (core.kernels.attention_window)
    max_attention_window: int | None = Field(
        None, ge=1, description="Attend to at most this many recent keys (sinks included); default: the engine's "
                                "max_attention_window; at most that.")
    sink_token_length: int | None = Field(
        None, ge=0, description="First tokens always attended to under a window; default: the engine's.")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        """0 (greedy) or at least MIN_TEMPERATURE: a smaller one (1e-320) divides the logits into inf / NaN."""
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"expected 0 (greedy) or at least {MIN_TEMPERATURE} (a smaller temperature divides the "
                             "logits past float32's range)")
        return value

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        for name, value in self:  # temperature=inf or top_p=nan is a mistake, not a setting
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} {value}: expected a finite number")
        if any(not text for text in self.stop_strings):
            raise ValueError("stop_strings: empty string")
        for name in ("stop_words", "bad_words"):
            for word in getattr(self, name):
                if isinstance(word, list) and (not word or min(word) < 0):
                    raise ValueError(f"{name}: {word!r} must be a non-empty list of token ids >= 0")
                if isinstance(word, str) and not word:
                    raise ValueError(f"{name}: empty string")
        if self.top_p_min > self.top_p:
            raise ValueError(f"top_p_min {self.top_p_min} is larger than top_p {self.top_p}")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"n {self.n} with beam_width {self.beam_width}: use one or the other")
        if self.guided is not None and self.beam_width > 1:
            raise ValueError(f"guided ({self.guided.kind}) with beam_width {self.beam_width}: beam search cannot "
                             "hold its beams to a grammar; use beam_width 1")
        if self.logits_processors and self.beam_width > 1:
            raise ValueError(f"logits_processors with beam_width {self.beam_width}: plugins' processors run on "
                             "sampled sequences only; use beam_width 1")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def padding_id(self) -> int:
        """pad_id, else end_id, else 0 (what pad_outputs should fill with)."""
        return self.pad_id if self.pad_id is not None else self.end_id if self.end_id is not None else 0

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def needs_chooser(self) -> bool:
        """False for plain requests: the batched fast path `sample` serves them."""
        return (self.is_beam_search or self.output_log_probs or self.top_log_probs > 0 or self.output_generation_logits
                or self.top_p_decay != 1.0 or self.top_p_reset_ids is not None or LogitsPipeline.wanted(self)
                or self.guided is not None or bool(self.logits_processors))

    @property
    def guided_only(self) -> bool:
        """Guided, and otherwise plain: speculative decoding may draft for it (core.runtime.speculative)."""
        return self.guided is not None and not (
            self.is_beam_search or self.output_log_probs or self.top_log_probs > 0 or self.output_generation_logits
            or self.top_p_decay != 1.0 or self.top_p_reset_ids is not None or LogitsPipeline.wanted(self)
            or bool(self.logits_processors))

    def token_words(self, name: str) -> list[list[int]]:
        """stop_words / bad_words as id sequences (text must be resolved first: LLM does it)."""
        words = getattr(self, name)
        if any(isinstance(w, str) for w in words):
            raise ValueError(f"{name} holds text; encode it with the tokenizer first (LLM.generate does)")
        return words

    def with_text_encoded(self, encode) -> SamplingConfig:
        """A copy whose text stop/bad words are id sequences: encode(text) -> ids. A word the tokenizer
        makes no token of (" " for many) could never match: a one-line BestiaryError naming it."""
        update = {}
        for name in ("stop_words", "bad_words"):
            words = getattr(self, name)
            if any(isinstance(w, str) for w in words):
                update[name] = [_encoded(name, w, encode) if isinstance(w, str) else w for w in words]
        return self.model_copy(update=update) if update else self


def _encoded(name: str, word: str, encode) -> list[int]:
    """The ids of a text stop / bad word; none is an error naming the word."""
    ids = list(encode(word))
    if not ids:
        raise BestiaryError(f"{name} {word[:40]!r}: the tokenizer makes no token of it, so it can never match; "
                            "give text that encodes to at least one token, or token ids")
    return ids


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded by `seed` (a random seed when None).

    Generators stay on the CPU whatever device the model runs on: `draw` brings the
    probabilities to them, so a seed gives the same tokens on every device.
    """
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from probs [V] (any device) with a CPU generator."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingConfig], generators: list[torch.Generator]) -> list[int]:
    """One token per row of logits [B, V] (the fast path: plain requests only)."""
    logits = logits.float()
    greedy = dispatch.argmax_rows(logits)
    out = []
    for row, p, gen, g in zip(logits, params, generators, greedy):
        if p.is_greedy:
            out.append(g)
            continue
        filtered = filter_logits(row / p.temperature, p.top_k, p.top_p)
        out.append(draw(torch.softmax(filtered, dim=-1), gen))
    return out


def decayed_top_p(current: float, token: int, config: SamplingConfig) -> float:
    """top_p for the next step (Factuality-enhanced LMs): reset on top_p_reset_ids, else
    max(current * top_p_decay, top_p_min)."""
    if config.top_p_reset_ids is not None and token == config.top_p_reset_ids:
        return config.top_p
    return max(current * config.top_p_decay, config.top_p_min)


class TokenChooser:
    """One non-beam request's sampler with state: processors, decayed top_p, outputs.

    choose(l): x = pipeline(l) (float32), then the plugins' processors (core.runtime.plugin_processors), then
    -inf where the grammar's mask forbids (guided requests);
    greedy: argmax x, log p = log_softmax(x)[token];
    otherwise y = filter(x / T, top_k, top_p_t), token ~ softmax(y), log p = log_softmax(y)[token].
    top_log_probs = k: the k largest entries of that same log_softmax, with their token ids.
    """

    def __init__(self, config: SamplingConfig, generator: torch.Generator, pipeline: LogitsPipeline | None,
                 prompt: list[int], matcher: GrammarMatcher | None = None,
                 plugins: PluginProcessors | None = None) -> None:
        self.config = config
        self.generator = generator
        self.pipeline = pipeline
        self.matcher = matcher  # guided requests: the grammar's state (core.runtime.guided)
        self.plugins = plugins  # the request's processors registered by plugins, with its ids so far
        self.state = pipeline.new_state(prompt) if pipeline else None
        self.top_p = config.top_p
        self.log_probs: list[float] = []
        self.top_log_probs: list[list[tuple[int, float]]] = []  # per step: (token, log p), most likely first
        self.logits: list[torch.Tensor] = []  # raw generation logits, [V] each

    def choose(self, row: torch.Tensor, mask: torch.Tensor | None = None) -> int:
        """The next token from this request's raw logits row [V] (and, guided, the grammar's mask [W] int32,
        filled for this step; None: filled here)."""
        cfg = self.config
        if cfg.output_generation_logits:
            self.logits.append(row.float().clone())
        x = row.float()
        if self.pipeline is not None and self.state is not None:  # made together: both or neither
            x = self.pipeline(x[None], [self.state])[0]
        if self.plugins is not None:
            x = self.plugins(x)
        if self.matcher is not None:
            allowed = self.grammar_mask() if mask is None else mask[None]  # [1, W]
            x = apply_bitmask(x[None], allowed)[0]
            if bool(torch.isneginf(x).all()):  # bans / penalties / processors left nothing the grammar allows:
                x = apply_bitmask(row.float()[None], allowed)[0]  # the grammar wins (the raw logits, masked)
        if cfg.is_greedy:
            token = dispatch.argmax_rows(x[None])[0]
            dist = x
        else:
            dist = filter_logits(x / cfg.temperature, cfg.top_k, self.top_p)
            token = draw(torch.softmax(dist, dim=-1), self.generator)
        if cfg.output_log_probs or cfg.top_log_probs:
            log_p = torch.log_softmax(dist, dim=-1)  # [V]
            self.log_probs.append(float(log_p[token]))
            if cfg.top_log_probs:
                top = torch.topk(log_p, cfg.top_log_probs)
                self.top_log_probs.append(list(zip(top.indices.tolist(), top.values.tolist())))
        if self.state is not None:
            self.state.push(token)
        if self.plugins is not None:
            self.plugins.push(token)
        if self.matcher is not None:
            self.matcher.take(token)
        self.top_p = decayed_top_p(self.top_p, token, cfg)
        return token

    def grammar_mask(self) -> torch.Tensor:
        """The matcher's mask for the next token, [1, W] int32."""
        assert self.matcher is not None, "grammar_mask of a request without a grammar"
        mask = torch.full((1, self.matcher.words), -1, dtype=torch.int32)
        self.matcher.fill(mask, 0)
        return mask


def pad_outputs(sequences: list[list[list[int]]], pad_id: int) -> torch.Tensor:
    """Output ids [batch, beams, longest] from per-request lists of per-beam ids, padded with pad_id."""
    beams = max((len(s) for s in sequences), default=0)
    longest = max((len(b) for s in sequences for b in s), default=0)
    out = torch.full((len(sequences), beams, longest), pad_id, dtype=torch.int64)
    for i, seq in enumerate(sequences):
        for j, ids in enumerate(seq):
            out[i, j, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


__all__ = [
    "ProcessorState",
    "SamplingConfig",
    "TokenChooser",
    "decayed_top_p",
    "filter_logits",
    "draw",
    "make_generator",
    "pad_outputs",
    "sample",
]
