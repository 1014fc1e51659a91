"""The synthetic requests every system is given, and the arithmetic of the reported figures.

Prompts are token ids drawn with a fixed seed (no tokenizer needed, the same ids for every
system). Decode speed is (t(1 + N) - t(1)) / N: the N tokens after the first, over the time
they added, so the prompt's prefill is not counted. Prefill speed is the time to the first
token (TTFT) of a prompt of L tokens, and L / TTFT prompt tokens/s. (The rewrite workload's
prompts are text, core.bench.rewrite; its speed is the same decode definition.)
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class Workload:
    """Requests submitted at once: prompt ids and how many tokens each asks for."""

    prompts: list[list[int]]
    max_new: list[int]

    @property
    def asked(self) -> int:
        """Generated tokens the workload asks for (EOS ignored)."""
        return sum(self.max_new)


@dataclass
class MixedResult:
    """One system on a mixed workload: wall time and each request's latency (submit -> last token)."""

    seconds: float
    latencies: list[float]
    generated: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


def token_range(vocab: int) -> tuple[int, int]:
    """Ids prompts are drawn from: above the low ids (specials in most vocabularies), below `vocab`."""
    return min(100, vocab // 2), vocab


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    """A prompt of `length` seeded random ids."""
    rng = random.Random(seed)
    lo, hi = token_range(vocab)
    return [rng.randrange(lo, hi) for _ in range(length)]


def mixed_workload(n: int, vocab: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                   seed: int) -> Workload:
    """`n` requests, prompt and output lengths uniform in their (inclusive) ranges."""
    rng = random.Random(seed)
    lo, hi = token_range(vocab)
    prompts = [[rng.randrange(lo, hi) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_lens) for _ in range(n)])


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 <= q <= 100) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Timed(NamedTuple):
    """One timed generation: wall seconds and the tokens it really produced."""

    seconds: float
    tokens: int


def decode_rate(generate: Callable[[int], Timed], n: int) -> float | None:
    """Decode tokens/s: the tokens after the first over the time they added, (t(1 + n) - t(1)) / n
    (a system that stopped early at an end id counts what it produced). None when the longer run
    was not slower (a machine too busy to measure on)."""
    return added_rate([(generate(1), generate(1 + n))])


def added_rate(pairs: list[tuple[Timed, Timed]]) -> float | None:
    """Over (1-token run, longer run) pairs of the same prompts: sum of the tokens the longer runs
    added over sum of the seconds they added; None when that is not positive (a busy machine)."""
    extra = sum(full.tokens - first.tokens for first, full in pairs)
    seconds = sum(full.seconds - first.seconds for first, full in pairs)
    return extra / seconds if extra > 0 and seconds > 0 else None


def median_of(repeats: int, measure: Callable[[], float | None]) -> float | None:
    """The median of the measurements that succeeded (None if none did)."""
    values = [v for v in (measure() for _ in range(repeats)) if v is not None]
    return statistics.median(values) if values else None
