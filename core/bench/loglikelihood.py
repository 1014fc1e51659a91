"""Scoring continuations on an engine, batched, for lm-evaluation-harness (core.bench.lm_eval_model).

For a pair (context c_1..c_m, continuation t_1..t_n) of token ids:

    loglikelihood = sum_j log_softmax(z_{m+j-1})[t_j]      j = 1..n
    greedy        = all_j argmax(z_{m+j-1}) == t_j

where z_i are the logits at position i of the input c_1..c_m t_1..t_{n-1} (the pair without its last
token, left-truncated to the engine's longest prompt, as lm-eval's `hf` model does).

Each distinct context is computed once, by one request (the leader: prompt c_1..c_m, one generated token,
its generation logits = z_m, the row of every continuation's first token). Each distinct t_1..t_{n-1}
of that context with n > 1 is a follower (`Executor.add(after=leader)`): it forks the leader's computed
context (full KV blocks shared, the partial last block copied) and computes only its n - 1 tokens, whose
context logits are z_{m+1}..z_{m+n-1}. So a multiple-choice question costs its context once plus its
choices' tokens, and one-token continuations cost nothing past the context (lm-eval's `hf` shares one
forward only between one-token continuations of one context; it computes every other pair whole).
Leaders also start from cached blocks of a prefix they share with earlier contexts (few-shot examples).

Batching: the groups (a leader and its followers, at most `max_in_flight` sequences: more followers go to
another leader of the same context) go to the executor in waves of at most `max_in_flight` sequences: a
wave's leaders prefill in one in-flight batch, then their followers in the next step (one that mixes long
prefill rows with context-logit rows would compute the LM head for every row).

A pair whose continuation fills the whole truncated input (no context token left), and every pair on a
model whose prompt K/V depend on later tokens (Executor.can_fork false: prefix-LM masks, 2D or LongRoPE
positions), is one standalone request with the context logits of all its rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.executor import Request
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

SCORE = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True, output_context_logits=True)
LEAD = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True, output_generation_logits=True)
Pair = tuple[int, list[int]]  # (pair index, continuation ids as scored)
Result = tuple[float, bool]  # (loglikelihood, greedy)


@dataclass
class _Job:
    """One leader and its followers (prompt = ids, suffixes = continuations without their last token), or
    (standalone) one request whose continuation rows are the last rows of its context logits."""

    ids: list[int]
    pairs: list[Pair] = field(default_factory=list)
    suffixes: list[tuple[int, ...]] = field(default_factory=list)  # one follower each
    standalone: bool = False
    requests: list[Request] = field(default_factory=list)  # [leader, *followers] once added

    @property
    def inputs(self) -> int:
        """The distinct inputs it scores (what lm-eval's `hf` batches): one per follower, one for the
        one-token continuations its leader's row scores."""
        return max(len(self.suffixes) + (len(self.pairs) > sum(len(c) > 1 for _, c in self.pairs)), 1)


def max_score_length(llm: LLM) -> int:
    """The longest input a score request may have: a prompt plus the one token it generates."""
    build = llm.engine.build  # an engine's limits are resolved when it is built
    limits = [n for n in (build.max_input_len, build.max_seq_len and build.max_seq_len - 1) if n]
    return min(limits)


def _jobs(pairs: list[tuple[list[int], list[int]]], max_len: int, cap: int, fork: bool) -> list[_Job]:
    """The jobs scoring `pairs` ((context, continuation) ids): one group per distinct truncated context (split
    so that none runs more than `cap` sequences), a standalone job per distinct input that has none."""
    groups: dict[tuple[int, ...], _Job] = {}
    alone: dict[tuple[int, ...], _Job] = {}
    for index, (context, continuation) in enumerate(pairs):
        if not continuation or not context:
            raise BestiaryError(f"loglikelihood request {index}: empty context or continuation token ids")
        whole = (context + continuation)[-(max_len + 1):]
        ids = whole[:-1]
        kept = len(ids) - (len(continuation) - 1)  # context tokens left after truncation
        if kept > 0 and fork and cap > 1:
            groups.setdefault(tuple(ids[:kept]), _Job(ids[:kept])).pairs.append((index, continuation))
        else:
            job = alone.setdefault(tuple(ids), _Job(ids, standalone=True))
            job.pairs.append((index, continuation[-len(ids):]))
    return [part for job in groups.values() for part in _split(job, cap)] + list(alone.values())


def _split(job: _Job, cap: int) -> list[_Job]:
    """`job` as leaders of the same context with at most cap - 1 followers each, one per distinct suffix
    (one-token continuations need none: the first leader's row scores them)."""
    by_suffix: dict[tuple[int, ...], list[Pair]] = {}
    for index, continuation in job.pairs:
        by_suffix.setdefault(tuple(continuation[:-1]), []).append((index, continuation))
    single = by_suffix.pop((), [])
    suffixes, room = list(by_suffix), cap - 1
    chunks = [suffixes[first : first + room] for first in range(0, len(suffixes), room)] or [[]]
    parts = [_Job(job.ids, [p for s in chunk for p in by_suffix[s]], chunk) for chunk in chunks]
    parts[0].pairs += single
    return parts


def _waves(jobs: list[_Job], cap: int) -> Iterator[list[_Job]]:
    """Consecutive jobs in waves of at most `cap` inputs (a larger job alone)."""
    wave: list[_Job] = []
    for job in jobs:
        if wave and sum(j.inputs for j in wave) + job.inputs > cap:
            yield wave
            wave = []
        wave.append(job)
    if wave:
        yield wave


def _rows(job: _Job) -> dict[tuple[int, ...], torch.Tensor]:
    """log_softmax of the rows that predict each suffix's continuations: suffix -> [len(suffix) + 1, V]
    (standalone: () -> the rows of the whole input [P, V])."""
    if job.standalone:
        return {(): torch.log_softmax(torch.cat(job.requests[0].context_logits).float(), dim=-1)}
    chooser = job.requests[0].chooser
    assert chooser is not None and chooser.logits, "a leader keeps its generation logits (LEAD)"
    first = chooser.logits[0][None]  # [1, V]: z_m, after the last context token
    rows: dict[tuple[int, ...], torch.Tensor] = {(): torch.log_softmax(first.float(), dim=-1)}
    for suffix, follower in zip(job.suffixes, job.requests[1:]):
        rows[suffix] = torch.log_softmax(torch.cat([first, *follower.context_logits]).float(), dim=-1)
    return rows


def _score(job: _Job) -> list[tuple[int, Result]]:
    """(pair index, (log p, greedy)) of each pair of a finished job."""
    rows = _rows(job)
    out = []
    for index, continuation in job.pairs:
        n = len(continuation)
        logp = rows[()][-n:] if job.standalone else rows[tuple(continuation[:-1])]  # [n, V]
        target = torch.tensor(continuation, dtype=torch.long)
        chosen = logp.gather(1, target[:, None])[:, 0]  # [n]
        out.append((index, (float(chosen.sum()), bool((logp.argmax(-1) == target).all()))))
    return out


def _add(llm: LLM, job: _Job, lora: LoraRequest | None) -> None:
    """Queue `job`'s requests: the leader (or the standalone request), then its followers after it."""
    stop_ids = llm.tokenizer.stop_ids if llm.tokenizer is not None else set()
    prompts = [job.ids] + [job.ids + list(s) for s in job.suffixes]
    for i, prompt in enumerate(prompts):
        adapter = llm.lora_store.take(lora)
        try:
            after = job.requests[0] if i else None
            sampling = SCORE if job.standalone or i else LEAD
            job.requests.append(llm.executor.add(list(prompt), sampling, stop_ids, lora=adapter, after=after))
        except BaseException:
            if adapter is not None:
                llm.lora_store.release(adapter)
            raise


def score_continuations(llm: LLM, pairs: list[tuple[list[int], list[int]]], max_in_flight: int | None = None,
                        lora: LoraRequest | None = None) -> list[Result]:
    """(loglikelihood, greedy) of each (context ids, continuation ids) pair (module docstring), in order;
    at most `max_in_flight` inputs per wave (default: the engine's max_batch_size)."""
    executor = llm.executor
    room = executor.build.max_batch_size
    jobs = _jobs(pairs, max_score_length(llm), room, executor.can_fork)
    waves = list(_waves(jobs, max_in_flight or room))
    waves.reverse()
    results: dict[int, Result] = {}
    active: list[_Job] = []
    try:
        while waves or active:
            if waves and all(job.requests[0].finished for job in active):  # the leaders are done
                for job in waves.pop():
                    active.append(job)  # first: a refused request cancels those of the job already queued
                    _add(llm, job, lora)
            executor.step()
            for job in [j for j in active if all(r.finished for r in j.requests)]:
                results.update(_score(job))
                active.remove(job)
    except BaseException:
        for req in (r for job in active for r in job.requests if not r.finished):
            executor.cancel(req)
        raise
    return [results[i] for i in range(len(pairs))]
