"""Scoring continuations on an engine, batched, for lm-evaluation-harness (core.bench.lm_eval_model).

For a pair (context c_1..c_m, continuation t_1..t_n) of token ids:

    loglikelihood = sum_j log_softmax(z_{m+j-1})[t_j]      j = 1..n
    greedy        = all_j argmax(z_{m+j-1}) == t_j

where z_i are the logits at position i of the input c_1..c_m t_1..t_{n-1} (the pair without its last
token, left-truncated to the engine's longest prompt, as lm-eval's `hf` model does). Pairs with the
same input share one request (lm-eval's one-token-continuation cache, for any length).

Every input is one executor request (max_new_tokens 1, context logits), at most `max_in_flight` at a
time in one in-flight batch. Prefix reuse: context logits turn off a request's reuse of cached blocks
(Executor._prepare_sampling), so that every prompt row is computed. Here only the rows of the
continuation are needed, so each request gets reuse back (`Executor.add(reuse_prefix=True)`): its context logits
then hold the rows of the positions it computed, [P - s, V] with s = the reused tokens (whole cached
blocks, never the last prompt token). The first request of each context runs first; the others of
that context wait for it, then reuse its blocks (first requests reuse what is cached already, e.g. a
few-shot prefix that other contexts share). A request whose reuse reached into its continuation
(s > P - n) is run again without reuse.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.adapter import LoraAdapter
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.executor import Request
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

SCORE = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True, output_context_logits=True)


@dataclass
class _Input:
    """One distinct input: its ids, the longest continuation scored on it, the pairs it answers."""

    ids: list[int]
    context: tuple[int, ...]  # the shared prefix its group reuses (the pair's context, truncated alike)
    longest: int = 0
    pairs: list[tuple[int, list[int]]] = field(default_factory=list)  # (pair index, continuation ids)
    reuse: bool = True


def max_score_length(llm: LLM) -> int:
    """The longest input a score request may have: a prompt plus the one token it generates."""
    build = llm.engine.build  # an engine's limits are resolved when it is built
    limits = [n for n in (build.max_input_len, build.max_seq_len and build.max_seq_len - 1) if n]
    return min(limits)


def _inputs(pairs: list[tuple[list[int], list[int]]], max_len: int) -> list[_Input]:
    """The distinct inputs of `pairs` ((context, continuation) ids), longest first."""
    by_ids: dict[tuple[int, ...], _Input] = {}
    for index, (context, continuation) in enumerate(pairs):
        if not continuation or not context:
            raise BestiaryError(f"loglikelihood request {index}: empty context or continuation token ids")
        whole = (context + continuation)[-(max_len + 1):]
        ids = whole[:-1]
        kept = max(len(ids) - (len(continuation) - 1), 0)  # context tokens left after truncation
        item = by_ids.setdefault(tuple(ids), _Input(ids, tuple(ids[:kept])))
        item.longest = max(item.longest, min(len(continuation), len(ids)))
        item.pairs.append((index, continuation[-len(ids):]))
    return sorted(by_ids.values(), key=lambda i: -len(i.ids))


def _score(item: _Input, logits: torch.Tensor, start: int) -> list[tuple[int, tuple[float, bool]]]:
    """(pair index, (log p, greedy)) of each pair of `item` from its context logits [P - start, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [P - start, V]
    out = []
    for index, continuation in item.pairs:
        n = len(continuation)
        rows = logp[len(item.ids) - n - start :]  # [n, V]: the rows that predict the continuation
        target = torch.tensor(continuation, dtype=torch.long)
        chosen = rows.gather(1, target[:, None])[:, 0]  # [n]
        out.append((index, (float(chosen.sum()), bool((rows.argmax(-1) == target).all()))))
    return out


class _Scheduler:
    """Leaders (the first input of each context) and followers (waiting for their leader's blocks)."""

    def __init__(self, inputs: list[_Input], reuse: bool) -> None:
        self.ready: list[_Input] = []
        self.waiting: dict[tuple[int, ...], list[_Input]] = defaultdict(list)
        for item in inputs:
            item.reuse = reuse
            if reuse and item.context in self.waiting:
                self.waiting[item.context].append(item)
            else:
                self.ready.append(item)
                self.waiting.setdefault(item.context, [])
        self.ready.reverse()  # pop() takes the longest first

    def done(self, item: _Input) -> None:
        """`item` ran: its context's followers may go (first, while its blocks are cached)."""
        self.ready += reversed(self.waiting.pop(item.context, []))

    def __bool__(self) -> bool:
        return bool(self.ready)


def score_continuations(llm: LLM, pairs: list[tuple[list[int], list[int]]], max_in_flight: int | None = None,
                        lora: LoraRequest | None = None) -> list[tuple[float, bool]]:
    """(loglikelihood, greedy) of each (context ids, continuation ids) pair (module docstring), in order."""
    executor = llm.executor
    cap = min(max_in_flight or executor.build.max_batch_size, executor.build.max_batch_size)
    schedule = _Scheduler(_inputs(pairs, max_score_length(llm)), executor.reuse)
    results: dict[int, tuple[float, bool]] = {}
    running: dict[int, tuple[Request, _Input]] = {}
    stop_ids = llm.tokenizer.stop_ids if llm.tokenizer is not None else set()
    try:
        while schedule or running:
            while schedule and len(running) < cap:
                item = schedule.ready.pop()
                adapter: LoraAdapter | None = llm.lora_store.take(lora)
                try:
                    req = executor.add(list(item.ids), SCORE, stop_ids, lora=adapter, reuse_prefix=item.reuse)
                except BaseException:
                    if adapter is not None:
                        llm.lora_store.release(adapter)
                    raise
                running[req.id] = (req, item)
            executor.step()
            for rid in [rid for rid, (req, _) in running.items() if req.finished]:
                req, item = running.pop(rid)
                _finish(req, item, schedule, results)
    except BaseException:
        for req, _ in running.values():
            executor.cancel(req)
        raise
    return [results[i] for i in range(len(pairs))]


def _finish(req: Request, item: _Input, schedule: _Scheduler, results: dict[int, tuple[float, bool]]) -> None:
    """Score a finished request, or queue it again without reuse when its rows start too late."""
    logits = torch.cat(req.context_logits)  # [P - start, V]
    req.context_logits.clear()
    start = len(item.ids) - logits.shape[0]
    if start > len(item.ids) - item.longest:  # reused blocks covered continuation rows: compute them all
        item.reuse = False
        schedule.ready.append(item)
        return
    results.update(_score(item, logits, start))
    schedule.done(item)
