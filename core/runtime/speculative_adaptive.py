"""Adaptive draft length for speculative decoding (core.runtime.speculative): k per sequence, from its
measured acceptance and the measured costs of a draft step and of a verification step, down to 0
(plain decoding) when drafting would not pay.

The model. A sequence whose drafts are each accepted with probability a (given that the drafts before
it were) emits, from one verification of k drafts,

    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)        (E(0) = 1: a plain step)

tokens. An executor step of R target rows costs F(R) seconds (the whole step, draft to draft, less the
drafting: metadata, forward, verification; averaged per R and fitted with a line c + s R, `StepCosts`),
and drafting k tokens costs k d (d: seconds per draft step, measured: a draft engine's batched decode
step, prompt lookup's search).
In a step of B decoding sequences, giving this sequence k drafts makes the step emit B - 1 + E(k)
tokens in F(B + k) + k d seconds:

    rate(k) = (B - 1 + E(k)) / (F(B + k) + k d)        rate(0) = B / F(B)

k* = argmax over k = 0 .. K of rate(k); the sequence drafts k* tokens when
rate(k*) >= (1 + margin) rate(0), else none. At B = 1 this is the expected speedup
E(k) F(1) / (F(1 + k) + k d) > 1 + margin: expected tokens per unit time, against plain decoding's.

Re-probing: a sequence at k = 0 drafts K tokens after `probe_interval` plain steps, so that its acceptance
keeps being measured (text can turn input-grounded). A probe costs F(B + K) - F(B) + K d once; each probe
in a row with no draft accepted doubles the wait before the next (up to 8 probe_interval), so that on text
where drafts never pay the probes cost a few percent at most.

Acceptance: a verification of k drafts with j accepted is j successes in j + [j < k] trials (the drafts
after the first rejection were never tried), so a = successes / trials estimates the per-draft rate of
E(k)'s geometric model without the bias of accepted / drafted. A sequence's counts decay by `decay` per
verification (recent text counts most) and start from the drafter's running average over all
sequences with the weight of `prior_trials` trials.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARGIN = 0.03  # draft only where the expected rate beats plain decoding's by 3% (estimates are noisy)
DECAY = 0.9  # a sequence's acceptance counts decay by this per verification
GLOBAL_DECAY = 0.98  # the drafter's running average decays by this per verification
PRIOR_TRIALS = 2.0  # weight of the running average in a new sequence's estimate
PRIOR_ACCEPTANCE = 0.5  # the running average before any verification
EMA = 0.2  # weight of a new cost sample
WARMUP_SAMPLES = 3  # cost samples before k is chosen (until then every sequence drafts K)
PRIOR_ROW_COST = 0.05  # F(R + 1) / F(R) - 1 assumed while only one row count was measured


def expected_tokens(a: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens one verification of k drafts emits, each draft accepted with
    probability a given the ones before it were."""
    return float(sum(a**i for i in range(k + 1)))


@dataclass
class StepCosts:
    """Measured seconds: F(R) per step of R target rows (EMA per R) and d per draft step (EMA)."""

    rows: dict[int, tuple[float, int]] = field(default_factory=dict)  # R -> (EMA seconds, samples)
    draft_step: float | None = None  # d
    samples: int = 0
    _line: tuple[float, float] | None = None  # `line`, until the next sample

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        """EMA with each sample clipped to [old / 2, 2 old] (one step delayed by the OS does not swing it)."""
        if old is None:
            return new
        return (1 - EMA) * old + EMA * min(max(new, old / 2), 2 * old)

    def add_step(self, rows: int, seconds: float) -> None:
        old = self.rows.get(rows)
        self.rows[rows] = (self._ema(old[0] if old else None, seconds), (old[1] if old else 0) + 1)
        self.samples += 1
        self._line = None

    def add_draft(self, seconds_per_step: float) -> None:
        self.draft_step = self._ema(self.draft_step, seconds_per_step)

    @property
    def ready(self) -> bool:
        return self.samples >= WARMUP_SAMPLES

    def line(self) -> tuple[float, float]:
        """(c, s) of F(R) = c + s R: the least-squares line through the per-R averages, each weighted by
        its samples (at most 20), s >= 0; with one row count measured, s = PRIOR_ROW_COST F(1) per row."""
        if self._line is not None:
            return self._line
        pts = [(r, f, min(n, 20)) for r, (f, n) in self.rows.items()]
        w = sum(p[2] for p in pts)
        mr, mf = sum(r * n for r, _, n in pts) / w, sum(f * n for _, f, n in pts) / w
        var = sum(n * (r - mr) ** 2 for r, _, n in pts)
        if var > 0:
            slope = max(sum(n * (r - mr) * (f - mf) for r, f, n in pts) / var, 0.0)
        else:
            slope = PRIOR_ROW_COST * mf / (1 + PRIOR_ROW_COST * (mr - 1))
        self._line = (mf - slope * mr, slope)
        return self._line

    def step(self, rows: int) -> float:
        """F(rows) in seconds, from `line` (at least a microsecond)."""
        c, slope = self.line()
        return max(c + slope * rows, 1e-6)

    def rate(self, batch: int, k: int, a: float) -> float:
        """rate(k) = (B - 1 + E(k)) / (F(B + k) + k d), tokens per second (module docstring)."""
        return (batch - 1 + expected_tokens(a, k)) / (self.step(batch + k) + k * (self.draft_step or 0.0))


@dataclass
class SeqState:
    """One sequence's decayed acceptance counts, its steps at k = 0 since it last drafted, and its
    probes in a row that had no draft accepted (each doubles the wait before the next, up to 8x)."""

    successes: float
    trials: float
    idle: int = 0
    failed_probes: int = 0
    probing: bool = False  # this step's drafts are a probe


class AdaptiveK:
    """Chooses each sequence's k (`choose`) and learns from its verifications (`observe`)."""

    def __init__(self, max_k: int, probe_interval: int = 8) -> None:
        self.max_k, self.probe_interval = max_k, probe_interval
        self.costs = StepCosts()
        self.seqs: dict[object, SeqState] = {}
        self.total = [PRIOR_ACCEPTANCE * PRIOR_TRIALS, PRIOR_TRIALS]  # decayed successes, trials over all
        self.choices: dict[int, int] = {}  # k -> times chosen (0: a plain step of a drafting-eligible sequence)
        self.probes = 0  # re-probes of sequences at k = 0 (counted in choices as their k)

    def acceptance(self, key: object) -> float:
        """The sequence's estimated per-draft acceptance a (the running average for a new one)."""
        s = self.seqs.get(key)
        prior = self.total[0] / self.total[1]
        if s is None:
            return prior
        return (s.successes + PRIOR_TRIALS * prior) / (s.trials + PRIOR_TRIALS)

    def best_k(self, a: float, batch: int, cap: int) -> int:
        """argmax over k = 0 .. cap of rate(k), 0 unless it beats rate(0) by MARGIN."""
        plain = self.costs.rate(batch, 0, a)
        best, best_rate = 0, plain * (1 + MARGIN)
        for k in range(1, cap + 1):
            r = self.costs.rate(batch, k, a)
            if r > best_rate:
                best, best_rate = k, r
        return best

    def choose(self, key: object, batch: int, cap: int) -> int:
        """This step's k for sequence `key` in a step of `batch` decoding sequences, at most `cap`."""
        if cap <= 0:
            return 0
        if not self.costs.ready:
            k = cap
        else:
            k = self.best_k(self.acceptance(key), batch, cap)
            s = self.seqs.setdefault(key, SeqState(0.0, 0.0))
            s.idle, s.probing = s.idle + 1 if k == 0 else 0, False
            if s.idle > self.probe_interval << min(s.failed_probes, 3):  # re-probe: K drafts measure a again
                k, s.idle, s.probing = cap, 0, True
                self.probes += 1
        self.choices[k] = self.choices.get(k, 0) + 1
        return k

    def observe(self, key: object, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts of which the first `accepted` were accepted."""
        if drafted <= 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        s = self.seqs.setdefault(key, SeqState(0.0, 0.0))
        if s.probing:
            s.failed_probes = 0 if accepted else s.failed_probes + 1
        s.successes, s.trials = DECAY * s.successes + accepted, DECAY * s.trials + trials
        self.total = [GLOBAL_DECAY * self.total[0] + accepted, GLOBAL_DECAY * self.total[1] + trials]

    def forget(self, live: set) -> None:
        """Drop the state of sequences not in `live` (finished requests)."""
        for key in [k for k in self.seqs if k not in live]:
            del self.seqs[key]
