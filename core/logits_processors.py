"""Logits processors: the per-request penalties and bans applied before a token is chosen.

Each function takes one row of float32 scores x [V] (logits, or log-probabilities in beam
search) and returns a new row; `LogitsPipeline` chains them for one request, in this order:

    embedding bias:      x_i += bias_i
    repetition penalty:  for i in set(prompt + output):  x_i = x_i * r if x_i < 0 else x_i / r
    presence/frequency:  x_i -= presence * (c_i > 0) + frequency * c_i,  c_i = count of i in output
    bad words:           x_last = -inf for each banned sequence whose prefix ends the sequence
    min length:          x_e = -inf for every end id e while len(output) < min_length

The repetition, bad-words and min-length steps give the same values as HF transformers'
RepetitionPenaltyLogitsProcessor, NoBadWordsLogitsProcessor and MinLengthLogitsProcessor
(with min_length counted in generated tokens, i.e. HF's min_length = prompt + min_length);
presence/frequency follow OpenAI's formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def repetition_penalty(x: torch.Tensor, ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """x [V], ids [L] (prompt + output): every token seen once or more is penalised once."""
    score = x.gather(0, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return x.scatter(0, ids, score)


def presence_frequency_penalty(x: torch.Tensor, output: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """x [V] - presence * (count > 0) - frequency * count, counts of the output ids [N] only."""
    counts = torch.bincount(output, minlength=x.shape[0]).to(x.dtype)  # [V]
    return x - presence * (counts > 0).to(x.dtype) - frequency * counts


def ban_bad_words(x: torch.Tensor, tokens: list[int], bad_words: list[list[int]]) -> torch.Tensor:
    """-inf at the last token of each bad word whose other tokens end `tokens` (single tokens: always)."""
    banned = [w[-1] for w in bad_words if len(w) - 1 <= len(tokens) and (len(w) == 1 or tokens[len(tokens) - len(w) + 1 :] == w[:-1])]
    if not banned:
        return x
    return x.index_fill(0, torch.tensor(banned, device=x.device), float("-inf"))


def min_length_mask(x: torch.Tensor, generated: int, min_length: int, end_ids: torch.Tensor) -> torch.Tensor:
    """-inf at the end ids while fewer than `min_length` tokens were generated."""
    if generated >= min_length or end_ids.numel() == 0:
        return x
    return x.index_fill(0, end_ids, float("-inf"))


def ends_with_any(tokens: list[int], words: list[list[int]]) -> bool:
    """True when `tokens` ends with one of `words` (a stop-word check)."""
    return any(len(w) <= len(tokens) and tokens[len(tokens) - len(w) :] == w for w in words)


@dataclass
class LogitsPipeline:
    """The processors one request asked for, prepared once (tensors built at add time)."""

    vocab_size: int
    embedding_bias: torch.Tensor | None = None  # [V] float32
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bad_words: list[list[int]] = field(default_factory=list)
    min_length: int = 0
    end_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @property
    def active(self) -> bool:
        """False when every step is the identity (the greedy fast path skips the pipeline)."""
        return (self.embedding_bias is not None or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.bad_words) or self.min_length > 0)

    def bias(self, x: torch.Tensor) -> torch.Tensor:
        """x [V] + embedding_bias (applied to raw logits, before any softmax)."""
        return x if self.embedding_bias is None else x + self.embedding_bias.to(x.device)

    def penalize(self, x: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        """Repetition, presence/frequency, bad words and min length on x [V] (float32)."""
        if self.repetition_penalty != 1.0:
            ids = torch.tensor(prompt + output, dtype=torch.int64, device=x.device)
            x = repetition_penalty(x, ids, self.repetition_penalty)
        if (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0) and output:
            out = torch.tensor(output, dtype=torch.int64, device=x.device)
            x = presence_frequency_penalty(x, out, self.presence_penalty, self.frequency_penalty)
        if self.bad_words:
            x = ban_bad_words(x, prompt + output, self.bad_words)
        if self.min_length:
            x = min_length_mask(x, len(output), self.min_length, self.end_ids.to(x.device))
        return x

    def __call__(self, x: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        """Every processor on raw logits x [V]."""
        return self.penalize(self.bias(x), prompt, output)
