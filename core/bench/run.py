"""One `bestiary bench` run: every system, one after the other, on the same requests.

For each system (engines first, then the peers in --compare order): open it, run the asked
workloads, close it; so only one system holds memory and threads at a time (FastLLM's threads
spin while its model lives). A peer that cannot run is a row with the reason, not an error.
With --rounds R the whole sequence runs R times and each figure of a system is the median of
its R rounds (the mixed and rewrite results: the round with the median rate): on a shared
machine whose speed drifts by tens of percent over minutes, every system then sees each phase.

- decode: warm up (4 tokens), then the median over `repeats` of (t(1 + N) - t(1)) / N.
- prefill: per prompt length L (within the system's input limit): the median over `repeats` of
  the time to the first token; prompt tokens/s = L / TTFT.
- mixed: the workload once; generated tokens/s, p50 / p99 latency (submit -> last token).
- fraction of the bandwidth limit (decode): tok/s x bytes read per token / read bandwidth.
- rewrite (engines only; core.bench.rewrite): per text, t(1) and t(1 + N) of the engine's chat
  prompt "Rewrite the following text ..."; the decode definition summed over the texts; median.
- speculative rows (an engine with --speculative): the drafted / accepted tokens of the decode
  workload's timed runs, of the rewrite workload's and of the mixed workload, each on its own;
  on rewrite also the speed over the same engine's plain row, and whether the outputs are its
  outputs token for token (greedy speculative decoding must reproduce plain decoding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bestiary.core.bench.config import BenchConfig
from bestiary.core.bench.machine import Machine, load_average, read_bandwidth_gbps
from bestiary.core.bench.peers import Candidate, PeerSkipped
from bestiary.core.bench.rewrite import RewriteResult, compare_to_plain, measure_rewrite
from bestiary.core.bench.systems import RewriteSystem, System
from bestiary.core.bench.workload import (
    MixedResult,
    decode_rate,
    median_of,
    mixed_workload,
    prompt_ids,
)
from bestiary.core.kernels.cpu.malloc import release_freed_memory
from bestiary.core.runtime.speculative import AcceptanceStats

T = TypeVar("T")


@dataclass
class Row:
    """One system's figures (None: not measured; `skipped`: why nothing was)."""

    name: str
    label: str
    skipped: str | None = None
    decode_tps: float | None = None
    ttft: dict[int, float | None] = field(default_factory=dict)  # prompt length -> seconds
    mixed: MixedResult | None = None
    mixed_note: str = ""
    bytes_per_token: int | None = None
    speculative: dict[str, AcceptanceStats] = field(default_factory=dict)  # workload -> its speculative counts
    rewrite: RewriteResult | None = None
    rewrite_note: str = ""  # why there is no rewrite figure

    def bandwidth_fraction(self, read_gbps: float | None) -> float | None:
        """Decode tok/s over the bandwidth limit read_gbps / bytes per token."""
        if not (self.decode_tps and self.bytes_per_token and read_gbps):
            return None
        return self.decode_tps * self.bytes_per_token / (read_gbps * 1e9)

    def to_json(self, read_gbps: float | None) -> dict:
        mixed = None
        if self.mixed is not None:
            mixed = {"seconds": self.mixed.seconds, "generated": self.mixed.generated,
                     "tokens_per_second": self.mixed.tokens_per_second,
                     "p50_seconds": self.mixed.percentile(50), "p99_seconds": self.mixed.percentile(99)}
        return {"name": self.name, "label": self.label, "skipped": self.skipped, "decode_tokens_per_second":
                self.decode_tps, "bytes_per_token": self.bytes_per_token,
                "bandwidth_fraction": self.bandwidth_fraction(read_gbps),
                "ttft_seconds": {str(k): v for k, v in self.ttft.items()}, "mixed": mixed,
                "mixed_note": self.mixed_note or None,
                "rewrite": self.rewrite.to_json() if self.rewrite else None, "rewrite_note": self.rewrite_note or None,
                "speculative": {w: speculative_json(s) for w, s in self.speculative.items()} or None}


def speculative_json(s: AcceptanceStats) -> dict:
    """A workload's speculative counts; acceptance_rate = accepted / drafted (0 without drafts)."""
    return s.to_json() | {"tokens_per_step": s.tokens_per_step}


@dataclass
class BenchReport:
    config: BenchConfig
    machine: Machine
    rows: list[Row]

    @property
    def differing(self) -> list[Row]:
        """Speculative rows whose rewrite output is not their plain row's (a bug: greedy must match)."""
        return [r for r in self.rows if r.rewrite is not None and r.rewrite.differs is not None]

    def to_json(self) -> dict:
        return {"config": self.config.model_dump(mode="json"), "machine": self.machine.to_json(),
                "rows": [r.to_json(self.machine.read_gbps) for r in self.rows]}


def measure(system: System, row: Row, config: BenchConfig, vocab: int, on_step: Callable[[str], None]) -> None:
    """Run the asked workloads on an open system, filling `row`."""
    row.bytes_per_token = system.bytes_per_token
    spec = getattr(system, "speculative_since", lambda: None)  # counts since its last call; None: plain
    if "decode" in config.workloads:
        on_step(f"{row.label}: decode")
        prompt = prompt_ids(config.decode_prompt_len, vocab, config.seed)
        system.generate(prompt, 4)  # warm-up
        spec()
        row.decode_tps = median_of(config.repeats,
                                   lambda: decode_rate(lambda n: system.generate(prompt, n), config.new_tokens))
        _keep_speculative(row, "decode", spec())
    if "prefill" in config.workloads:
        for length in config.prompt_lens:
            on_step(f"{row.label}: prefill {length}")
            if system.max_prompt_len is not None and length > system.max_prompt_len:
                row.ttft[length] = None
                continue
            prompt = prompt_ids(length, vocab, config.seed + length)
            row.ttft[length] = median_of(config.repeats, _first_token_seconds(system, prompt))
    if "rewrite" in config.workloads:
        on_step(f"{row.label}: rewrite")
        _rewrite(system, row, config, spec)
    if "mixed" in config.workloads:
        on_step(f"{row.label}: mixed")
        work = mixed_workload(config.mixed_requests, vocab, config.mixed_prompt_lens, config.mixed_output_lens,
                              config.seed)
        spec()
        row.mixed = system.mixed(work)
        row.mixed_note = system.mixed_note if row.mixed is None else ""
        _keep_speculative(row, "mixed", spec())


def _first_token_seconds(system: System, prompt: list[int]) -> Callable[[], float]:
    """One timed prefill of `prompt` (a generation of 1 token): its seconds."""
    return lambda: system.generate(prompt, 1).seconds


def _rewrite(system: System, row: Row, config: BenchConfig, spec: Callable[[], AcceptanceStats | None]) -> None:
    if not isinstance(system, RewriteSystem):
        row.rewrite_note = "bestiary engines only (the prompts are text in the engine's own chat template)"
        return
    prompts = system.rewrite_prompts(config.rewrite_texts, config.rewrite_text_tokens)
    longest, limit = max(map(len, prompts)), system.max_prompt_len
    if limit is not None and longest > limit:
        row.rewrite_note = (f"its prompts of up to {longest} tokens exceed max_input_len {limit} "
                            "(--rewrite_text_tokens)")
        return
    system.complete(prompts[0], 4)  # warm-up
    spec()
    row.rewrite = measure_rewrite(system.complete, prompts, config.new_tokens, config.repeats)
    _keep_speculative(row, "rewrite", spec())


def _keep_speculative(row: Row, workload: str, stats: AcceptanceStats | None) -> None:
    if stats is not None:
        row.speculative[workload] = stats


def measure_round(config: BenchConfig, systems: list[Candidate], vocab: int,
                  on_step: Callable[[str], None]) -> list[Row]:
    """Open, measure and close each system in turn: a row each."""
    rows = []
    for cand in systems:
        row = Row(cand.name, cand.label, skipped=cand.skipped)
        rows.append(row)
        if cand.skipped is not None:
            continue
        assert cand.open is not None, "a candidate that is not skipped opens"
        try:
            system = cand.open()
        except PeerSkipped as why:
            row.skipped = str(why)
            continue
        try:
            measure(system, row, config, vocab, on_step)
        finally:
            system.close()
            del system  # dropped before the next system opens: two 3B engines at once do not fit 24 GB
            release_freed_memory()  # and its freed heap handed back (glibc keeps up to 512 MiB otherwise)
    return rows


def _median_by(items: list[T | None], rate: Callable[[T], Any] = lambda x: x) -> T | None:
    """The item whose rate is the median of the measured ones (the lower middle of an even count);
    None if none was."""
    known = sorted((x for x in items if x is not None and rate(x) is not None), key=rate)
    return known[(len(known) - 1) // 2] if known else None


def merge_rounds(rounds: list[Row]) -> Row:
    """One system's rows of every round as one row: each figure the median over the rounds that
    measured it; the speculative counts summed. A system skipped in any round is skipped."""
    first = rounds[0]
    skipped = next((r.skipped for r in rounds if r.skipped is not None), None)
    if len(rounds) == 1 or skipped is not None:
        first.skipped = skipped
        return first
    merged = Row(first.name, first.label, bytes_per_token=first.bytes_per_token)
    merged.decode_tps = _median_by([r.decode_tps for r in rounds])
    merged.ttft = {length: _median_by([r.ttft.get(length) for r in rounds]) for length in first.ttft}
    merged.mixed = _median_by([r.mixed for r in rounds], lambda m: m.tokens_per_second)
    merged.mixed_note = first.mixed_note
    merged.rewrite = _median_by([r.rewrite for r in rounds], lambda w: w.tokens_per_second) or first.rewrite
    merged.rewrite_note = first.rewrite_note
    for workload in first.speculative:
        counts = [r.speculative.get(workload, AcceptanceStats()) for r in rounds]
        merged.speculative[workload] = AcceptanceStats(*(sum(getattr(c, f) for c in counts)
                                                         for f in ("steps", "drafted", "accepted")))
    return merged


def run_bench(config: BenchConfig, systems: list[Candidate], vocab: int,
              on_step: Callable[[str], None] = lambda _: None) -> BenchReport:
    """Every system measured in turn, --rounds times; `on_step` hears what is being measured."""
    machine = Machine.now(config.bandwidth_mib)
    machine.read_gbps_probes = [machine.read_gbps] if machine.read_gbps else []
    rounds = []
    for r in range(config.rounds):
        if r and config.bandwidth_mib:  # a probe before each round: the best is the one least slowed by others
            machine.read_gbps_probes.append(read_bandwidth_gbps(config.bandwidth_mib))
            machine.read_gbps = max(machine.read_gbps_probes)
        say = on_step if config.rounds == 1 else (lambda what, r=r: on_step(f"round {r + 1}/{config.rounds}: {what}"))
        rounds.append(measure_round(config, systems, vocab, say))
    rows = [merge_rounds([rows[i] for rows in rounds]) for i in range(len(systems))]
    machine.load_after = load_average()
    for cand, row in zip(systems, rows, strict=True):  # speculative rows against their plain row
        plain = next((r for c, r in zip(systems, rows, strict=True) if c is cand.plain), None)
        if plain is not None and row.rewrite is not None and plain.rewrite is not None:
            compare_to_plain(row.rewrite, plain.rewrite, plain.label)
    return BenchReport(config, machine, rows)
