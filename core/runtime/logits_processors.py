"""Logits processors: the per-request penalties and bans applied before a token is chosen.

Each function takes float32 scores x [N, V] (logits, or log-probabilities in beam search)
and returns new scores; `LogitsPipeline` chains the ones a request asked for, in this order:

    embedding bias:      x_i += bias_i                                  (raw logits only)
    repetition penalty:  for i in set(prompt + output):  x_i = x_i * r if x_i < 0 else x_i / r
    presence/frequency:  x_i -= presence * (c_i > 0) + frequency * c_i,  c_i = count of i in output
    bad words:           x_last = -inf for each banned sequence whose other tokens end prompt + output
    min length:          x_e = -inf for every end id e while len(output) < min_length

Repetition, bad words and min length give the values of HF transformers'
RepetitionPenaltyLogitsProcessor, NoBadWordsLogitsProcessor and
MinNewTokensLengthLogitsProcessor; presence/frequency is OpenAI's formula. The state a
sequence needs (`ProcessorState`: the ids seen, the output counts) is updated by one
`push` per token, so a step costs O(V), not O(sequence length).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bestiary.core.runtime.sampling import SamplingConfig


def repetition_penalty(x: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """x [N, V], seen [N, V] bool (token in prompt + output): seen tokens scaled once by the penalty."""
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def presence_frequency_penalty(x: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """x [N, V] - presence * (counts > 0) - frequency * counts; counts [N, V] of the output ids only."""
    return x - presence * (counts > 0).to(x.dtype) - frequency * counts


def banned_tokens(tokens: list[int], bad_words: list[list[int]]) -> list[int]:
    """Last token of each bad word whose other tokens end `tokens` (single-token words: always)."""
    out = []
    for w in bad_words:
        k = len(w) - 1
        if k == 0 or (k <= len(tokens) and tokens[len(tokens) - k :] == w[:-1]):
            out.append(w[-1])
    return out


def min_length_mask(x: torch.Tensor, generated: list[int], min_length: int, end_ids: torch.Tensor) -> torch.Tensor:
    """x [N, V] with -inf at the end ids of the rows that generated fewer than `min_length` tokens."""
    short = torch.tensor([g < min_length for g in generated], device=x.device)  # [N]
    if end_ids.numel() == 0 or not bool(short.any()):
        return x
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, end_ids] = True
    return x.masked_fill(mask & short[:, None], float("-inf"))


def stack_rows(rows: list[torch.Tensor | None], what: str) -> torch.Tensor:
    """The per-sequence vectors [V] as one [N, V] tensor; new_state made each one, as the pipeline needs it."""
    present = [r for r in rows if r is not None]
    assert len(present) == len(rows), f"a ProcessorState has no {what}: made by another pipeline's new_state"
    return torch.stack(present)


def ends_with_any(tokens: list[int], words: list[list[int]]) -> bool:
    """True when `tokens` ends with one of `words` (the stop-word check)."""
    return any(len(w) <= len(tokens) and tokens[len(tokens) - len(w) :] == w for w in words)


class ProcessorState:
    """What the processors need to know about one sequence (one beam)."""

    __slots__ = ("counts", "prompt_len", "seen", "tokens")

    def __init__(self, tokens: list[int], prompt_len: int, seen: torch.Tensor | None,
                 counts: torch.Tensor | None) -> None:
        self.tokens = tokens  # prompt + output
        self.prompt_len = prompt_len
        self.seen = seen  # [V] bool, or None when no repetition penalty
        self.counts = counts  # [V] float32 output counts, or None without presence/frequency

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def push(self, token: int) -> None:
        """Account for one generated token."""
        self.tokens.append(token)
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1

    def fork(self) -> ProcessorState:
        """An independent copy (a beam's child)."""
        return ProcessorState(list(self.tokens), self.prompt_len,
                              None if self.seen is None else self.seen.clone(),
                              None if self.counts is None else self.counts.clone())


class LogitsPipeline:
    """The processors one request asked for, prepared once (tensors built when the request is added)."""

    def __init__(self, config: SamplingConfig, vocab_size: int, end_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.embedding_bias = bias_vector(config.embedding_bias, vocab_size)
        self.repetition = config.repetition_penalty
        self.presence = config.presence_penalty
        self.frequency = config.frequency_penalty
        self.bad_words = config.token_words("bad_words")
        self.min_length = config.min_length
        self.end_ids = torch.tensor(sorted(end_ids), dtype=torch.int64)

    @staticmethod
    def wanted(config: SamplingConfig) -> bool:
        """False when every processor would be the identity (the greedy fast path skips them)."""
        return (config.embedding_bias is not None or config.repetition_penalty != 1.0
                or config.presence_penalty != 0.0 or config.frequency_penalty != 0.0
                or bool(config.bad_words) or config.min_length > 0)

    def new_state(self, prompt: list[int]) -> ProcessorState:
        """State of a sequence that starts with `prompt`."""
        seen = counts = None
        if self.repetition != 1.0:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            seen[torch.tensor(prompt, dtype=torch.int64)] = True
        if self.presence != 0.0 or self.frequency != 0.0:
            counts = torch.zeros(self.vocab_size, dtype=torch.float32)
        return ProcessorState(list(prompt), len(prompt), seen, counts)

    def bias(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, V] + embedding_bias (on raw logits, before any softmax)."""
        return x if self.embedding_bias is None else x + self.embedding_bias.to(x.device)

    def penalize(self, x: torch.Tensor, states: list[ProcessorState]) -> torch.Tensor:
        """Repetition, presence/frequency, bad words and min length on x [N, V] float32."""
        if self.repetition != 1.0:
            x = repetition_penalty(x, stack_rows([s.seen for s in states], "seen").to(x.device), self.repetition)
        if self.presence != 0.0 or self.frequency != 0.0:
            counts = stack_rows([s.counts for s in states], "counts").to(x.device)
            x = presence_frequency_penalty(x, counts, self.presence, self.frequency)
        if self.bad_words:
            for row, state in enumerate(states):
                banned = banned_tokens(state.tokens, self.bad_words)
                if banned:
                    x[row, banned] = float("-inf")
        if self.min_length:
            x = min_length_mask(x, [s.generated for s in states], self.min_length, self.end_ids.to(x.device))
        return x

    def __call__(self, x: torch.Tensor, states: list[ProcessorState]) -> torch.Tensor:
        """Every processor on raw logits x [N, V] (one state per row)."""
        return self.penalize(self.bias(x).clone(), states)


def bias_vector(bias: list[float] | dict[int, float] | None, vocab_size: int) -> torch.Tensor | None:
    """The embedding bias as a [V] float32 tensor (a full list, or {token id: bias})."""
    if bias is None:
        return None
    if isinstance(bias, dict):
        out = torch.zeros(vocab_size, dtype=torch.float32)
        for token, value in bias.items():
            if not 0 <= token < vocab_size:
                raise ValueError(f"embedding_bias: token id {token} is outside the vocabulary [0, {vocab_size})")
            out[token] = value
        return out
    if len(bias) != vocab_size:
        raise ValueError(f"embedding_bias has {len(bias)} values; expected vocab_size = {vocab_size}")
    return torch.tensor(bias, dtype=torch.float32)
