"""The rich tables of `bestiary bench`: decode, prefill, mixed and rewrite, with ratios to one reference
row (and, on rewrite, a speculative row's ratio to its own engine's plain row)."""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table

from bestiary.core.bench.config import BenchConfig
from bestiary.core.bench.run import BenchReport, Row
from bestiary.core.cli.commands import stdout_console
from bestiary.core.format.errors import BestiaryError


def reference_row(rows: list[Row], name: str | None, has_value: Callable[[Row], object]) -> Row | None:
    """The first measured row named `name` (engine, hf, llama.cpp, fastllm); by default the first
    measured peer, else the first engine. `has_value(row)` says whether the row has the figure."""
    measured = [r for r in rows if r.skipped is None and has_value(r)]
    if name is not None:
        if name not in {r.name for r in rows}:
            raise BestiaryError(f"--reference {name}: no such row; expected one of "
                                f"{', '.join(dict.fromkeys(r.name for r in rows))}")
        return next((r for r in measured if r.name == name), None)
    return next((r for r in measured if r.name != "engine"), measured[0] if measured else None)


def rounds_note(c: BenchConfig) -> str:
    """', median of R rounds' where the systems were measured R > 1 times in turn."""
    return f", median of {c.rounds} rounds" if c.rounds > 1 else ""


def vs_column(ref: Row | None) -> str:
    """The ratio column's header: 'vs' and the reference row's label up to its bracketed build notes
    (a llama.cpp row's CPU features stay in its own row, not in every line of the header)."""
    return f"vs {ref.label.split(' [', 1)[0]}" if ref else "vs -"


def ratio(value: float | None, ref: float | None) -> str:
    """value / ref as '1.23x'; '-' where either is missing (or zero)."""
    return f"{value / ref:.2f}x" if value and ref else "-"


def prompt_rate(row: Row, n: int | None) -> float | None:
    """Prompt tokens per second of `row` at prompt length `n` (None: not measured)."""
    seconds = row.ttft.get(n) if n else None
    return n / seconds if n and seconds else None


def decode_table(report: BenchReport, ref_name: str | None) -> Table:
    c, gbps = report.config, report.machine.read_gbps
    ref = reference_row(report.rows, ref_name, lambda r: r.decode_tps)
    probes = report.machine.read_gbps_probes
    spread = f" (best of {len(probes)} probes, {min(probes):.1f}-{max(probes):.1f})" if len(probes) > 1 else ""
    bw = f"read bandwidth {gbps:.1f} GB/s{spread}" if gbps else "bandwidth not measured"
    table = Table(title=f"batch-1 decode: {c.new_tokens} new tokens after {c.decode_prompt_len}, greedy, "
                        f"median of {c.repeats}{rounds_note(c)}; {bw}")
    for col in ("system", "tok/s", vs_column(ref), "MB read / token", "% of bandwidth limit"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in report.rows:
        if r.skipped is None:
            frac = r.bandwidth_fraction(gbps)
            tps = f"{r.decode_tps:.1f}" if r.decode_tps else "unstable"  # every repeat's longer run was not slower
            table.add_row(r.label, tps, ratio(r.decode_tps, ref.decode_tps if ref else None),
                          f"{r.bytes_per_token / 1e6:.0f}" if r.bytes_per_token else "-",
                          f"{100 * frac:.0f}%" if frac else "-")
    return table


def prefill_table(report: BenchReport, ref_name: str | None) -> Table:
    lens = report.config.prompt_lens
    def longest(row: Row) -> int | None:
        return next((n for n in reversed(lens) if row.ttft.get(n)), None)

    ref = reference_row(report.rows, ref_name, longest)
    table = Table(title=f"prefill: time to first token, median of {report.config.repeats}"
                        f"{rounds_note(report.config)} (prompt tok/s at the longest measured prompt)")
    table.add_column("system")
    for n in lens:
        table.add_column(f"TTFT {n} ms", justify="right")
    table.add_column("prompt tok/s", justify="right")
    table.add_column(vs_column(ref), justify="right")
    for r in report.rows:
        if r.skipped is not None or not r.ttft:
            continue
        at = longest(r)
        rate, ref_rate = prompt_rate(r, at), prompt_rate(ref, at) if ref else None
        table.add_row(r.label, *(f"{1000 * t:.0f}" if (t := r.ttft.get(m)) else "-" for m in lens),
                      f"{rate:,.0f}" if rate else "-", ratio(rate, ref_rate))
    return table


def mixed_table(report: BenchReport, ref_name: str | None) -> Table:
    c = report.config
    ref = reference_row(report.rows, ref_name, lambda r: r.mixed)
    table = Table(title=f"mixed: {c.mixed_requests} requests submitted at once, prompts "
                        f"{c.mixed_prompt_lens[0]}..{c.mixed_prompt_lens[1]}, outputs {c.mixed_output_lens[0]}.."
                        f"{c.mixed_output_lens[1]} (hf: static batches of {c.static_batch}){rounds_note(c)}")
    for col in ("system", "generated tok/s", vs_column(ref), "p50 latency s", "p99 latency s"):
        table.add_column(col, justify="left" if col == "system" else "right")
    ref_tps = ref.mixed.tokens_per_second if ref and ref.mixed else None
    for r in report.rows:
        if r.skipped is None and r.mixed is not None:
            m = r.mixed
            table.add_row(r.label, f"{m.tokens_per_second:.1f}", ratio(m.tokens_per_second, ref_tps),
                          f"{m.percentile(50):.2f}", f"{m.percentile(99):.2f}")
        elif r.skipped is None and r.mixed_note:
            table.add_row(r.label, "-", "-", "-", "-", style="dim")
    return table


def rewrite_table(report: BenchReport, ref_name: str | None) -> Table:
    c = report.config
    ref = reference_row(report.rows, ref_name, lambda r: r.rewrite and r.rewrite.tokens_per_second)
    measured = [(r, r.rewrite) for r in report.rows if r.skipped is None and r.rewrite is not None]
    lens = sorted({n for _, w in measured for n in w.prompt_tokens})
    prompts = f"prompts {lens[0]}..{lens[-1]} tokens" if lens else "no prompts"
    texts = max((len(w.prompt_tokens) for _, w in measured), default=c.rewrite_texts)
    table = Table(title=f"rewrite: batch-1 greedy decode of {texts} x \"Rewrite the following text ...\" "
                        f"(~{c.rewrite_text_tokens}-token passages, chat template, {prompts}), up to "
                        f"{c.new_tokens} new tokens (stop at EOS), tok/s = (t(1 + N) - t(1)) / N, median of {c.repeats}"
                        f"{rounds_note(c)}")
    for col in ("system", "tok/s", vs_column(ref), "x plain", "acceptance",
                "tokens / verify step", "output = plain"):
        table.add_column(col, justify="left" if col == "system" else "right")
    ref_tps = ref.rewrite.tokens_per_second if ref and ref.rewrite else None
    for r, w in measured:
        s = r.speculative.get("rewrite")
        table.add_row(r.label, f"{w.tokens_per_second:.1f}" if w.tokens_per_second else "unstable",
                      ratio(w.tokens_per_second, ref_tps),
                      f"{w.vs_plain:.2f}x" if w.vs_plain else "-",
                      f"{s.acceptance_rate:.0%} ({s.accepted}/{s.drafted})" if s and s.drafted else "-",
                      f"{s.tokens_per_step:.2f}" if s and s.steps else "-",
                      "-" if w.plain_label is None else "yes" if w.differs is None else f"NO ({w.differs})")
    return table


def print_report(report: BenchReport, ref_name: str | None) -> None:
    out, m = stdout_console(), report.machine
    out.print(f"CPU {m.cpu} ({m.cores} cores; flags: {', '.join(m.cpu_flags) or 'unknown'}), {m.threads} threads, "
              f"torch {m.torch}; load average {m.load_before} before, {m.load_after} after", highlight=False)
    out.print(f"CPU kernels: {m.cpu_isa} ({m.cpu_kernels})", highlight=False)
    work = report.config.workloads
    for name, make in (("decode", decode_table), ("prefill", prefill_table), ("mixed", mixed_table),
                       ("rewrite", rewrite_table)):
        if name in work:
            out.print(make(report, ref_name))
    for r in report.rows:
        if r.skipped is not None:
            out.print(f"skipped {r.label}: {r.skipped}", highlight=False)
        elif r.mixed is None and r.mixed_note and "mixed" in work:
            out.print(f"no mixed row for {r.label}: {r.mixed_note}", highlight=False)
        if r.skipped is None and r.rewrite_note and "rewrite" in work:
            out.print(f"no rewrite row for {r.label}: {r.rewrite_note}", highlight=False)
        for n, t in r.ttft.items():
            if t is None:
                out.print(f"no TTFT {n} for {r.label}: longer than its longest prompt", highlight=False)
        for workload, stats in r.speculative.items():  # e.g. "bestiary engine + ngram k=4, decode: accepted ..."
            out.print(f"{r.label}, {workload}: {stats.summary()}", highlight=False)
