"""Speculative decoding: draft k tokens cheaply, verify them in one forward of the target model.

A decoding sequence t_0 .. t_{L-1} (K/V cached for t_0 .. t_{L-2}) with drafts d_1 .. d_k runs
the chunk [t_{L-1}, d_1, .., d_k] through the model like a chunked prefill over its cache; row j
of the chunk's logits is the target's distribution p_j of the token after d_j (d_0 = t_{L-1}).

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023), with deterministic drafts (q_j is one-hot at d_j, for both drafters here):

    for j = 1 .. k:  accept d_j with probability min(1, p_{j-1}(d_j) / q(d_j)) = p_{j-1}(d_j);
                     on rejection emit x ~ norm(max(0, p_{j-1} - q)) = p_{j-1} with d_j removed, stop
    all accepted:    emit a bonus token x ~ p_k

so each emitted token has exactly the target's distribution:
P(x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x). Greedy (temperature 0 or
top_k 1) is the limit: accept while d_j == argmax p_{j-1}, then emit that argmax; the output is
the plain greedy output. p_j is the sampling distribution plain decoding would use:
softmax(filter(logits / T, top_k, top_p)).

Drafters:
  ngram (prompt lookup): the tokens that followed the latest earlier occurrence of the
      sequence's last n tokens (n = ngram_max down to ngram_min) in its own prompt + output;
  draft: a smaller bestiary engine with the same vocabulary (e.g. the W4A16 engine of the
      bf16 one) decoding k tokens greedily over its own paged KV cache (`DraftModel`).

After verification the sequence keeps the K/V of t_{L-1}, d_1 .. d_a (a accepted): the slots of
rejected drafts are dead and the blocks past the kept tokens go back to the request's
reservation (the executor's rollback).

Guided requests (core.runtime.guided): a draft is cut to the prefix its grammar accepts before it
runs; verification fills the grammar's mask m_j after d_1 .. d_j for every row j (the matcher walks
the drafts, then rolls back), applies it to row j (p_j is then zero outside the grammar, so a
rejected draft is never emitted) and advances the matcher by the tokens emitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.kernels.sampling_ref import filter_logits
from bestiary.core.runtime.cpu_plan import MAX_BATCH
from bestiary.core.runtime.guided import apply_bitmask
from bestiary.core.runtime.sampling import SamplingConfig, draw
from bestiary.core.runtime.speculative_adaptive import AdaptiveK
from bestiary.core.runtime.speculative_config import SpeculativeConfig, speculative_config  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from bestiary.core.runtime.executor import Executor, Request, Row


@dataclass
class AcceptanceStats:
    """Per-request (or aggregated) counters of speculative steps."""

    steps: int = 0  # verification forwards with at least one draft
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification forward: (accepted + steps) / steps (an upper bound
        when a stop cut a step short)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def summary(self) -> str:
        """One line: accepted of drafted (rate), tokens per verification step."""
        return (f"accepted {self.accepted} of {self.drafted} draft tokens ({self.acceptance_rate:.0%}), "
                f"{self.tokens_per_step:.2f} tokens per verification step")

    def to_json(self) -> dict:
        """{steps, drafted_tokens, accepted_tokens, acceptance_rate}: serve's usage.speculative and
        bench --json."""
        return {"steps": self.steps, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.acceptance_rate}

    def add(self, other: AcceptanceStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted


def ngram_draft(tokens: list[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt lookup: up to k tokens that followed the latest earlier occurrence of the last n
    tokens of `tokens`, for the longest n in ngram_max .. ngram_min that occurs; [] if none."""
    size = len(tokens)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = tokens[size - n :]
        first = suffix[0]
        for start in range(size - n - 1, -1, -1):  # latest occurrence first, never the suffix itself
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [R, V] -> the distributions plain sampling draws from, [R, V] float32:
    softmax(filter(logits / T, top_k, top_p)) per row."""
    rows = [filter_logits(row / sampling.temperature, sampling.top_k, sampling.top_p) for row in logits.float()]
    return torch.softmax(torch.stack(rows), dim=-1)


def accept_drafts(logits: torch.Tensor, draft: list[int], sampling: SamplingConfig,
                  generator: torch.Generator) -> list[int]:
    """The tokens one verification emits: the accepted prefix of `draft`, then one more token
    (the correction at the first rejection, or the bonus after the last draft).

    logits [k + 1, V]: row j is the target's logits after draft token j (row 0: after the last
    accepted token). Greedy: accept while draft[j] == argmax row j. Sampled: the rule in the
    module docstring (one uniform per draft, from the request's generator).
    """
    if sampling.is_greedy:
        best = logits.float().argmax(dim=-1).tolist()  # [k + 1]
        out = []
        for j, d in enumerate(draft):
            if d != best[j]:
                break
            out.append(d)
        return out + [best[len(out)]]
    probs = target_probs(logits, sampling)  # [k + 1, V]
    out = []
    for j, d in enumerate(draft):
        u = float(torch.rand((), generator=generator))
        if u < float(probs[j, d]):
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # norm(max(0, p - q)) for q one-hot at d
        return out + [draw(residual, generator)]
    return out + [draw(probs[len(draft)], generator)]


def grammar_prefix(req: Request, draft: list[int]) -> list[int]:
    """The part of `draft` a guided request's grammar accepts from where it is (all of it otherwise)."""
    matcher = req.chooser.matcher if req.chooser is not None else None
    return draft if matcher is None or not draft else draft[: matcher.valid_prefix(draft)]


def guided_rows(req: Request, logits: torch.Tensor) -> torch.Tensor:
    """logits [1 + k, V] of a guided request's verification with row j masked by its grammar after
    draft tokens 1 .. j: the matcher walks the (grammar-checked) drafts, then rolls back."""
    matcher = req.chooser.matcher if req.chooser is not None else None
    if matcher is None:
        return logits
    masks = torch.full((len(req.draft) + 1, matcher.words), -1, dtype=torch.int32)  # [1 + k, W]
    walked = 0
    for j in range(len(req.draft) + 1):
        matcher.fill(masks, j)
        if j < len(req.draft):
            if not matcher.accept(req.draft[j]):
                raise RuntimeError(f"draft token {req.draft[j]} was checked against the grammar, then refused")
            walked += 1
    matcher.rollback(walked)
    return apply_bitmask(logits.float(), masks)


@dataclass
class DraftRow:
    """Draft token j of a request as a one-token decode row of the verification step: position
    L - 1 + j over the request's own block table. Every verified token then runs exactly as a
    decode step of the sequence would (the same batched decode path, bit for bit), which keeps
    greedy output identical to plain decoding in every dtype."""

    tokens: list[int]  # the request's tokens, then its drafts
    num_cached: int  # tokens before this one: L - 1 + j
    blocks: list[int]  # the request's block table (the same list: growing it grows the request's)
    prompt: list[int]


class Drafter:
    """Proposes draft tokens for decoding sequences; `release` when a sequence ends. `step_seconds`:
    the mean seconds of the last `propose`'s draft steps, where a drafter times them itself (a draft
    engine: without the prefill-like catch-up of a new prompt); None: the whole call's time / k."""

    step_seconds: float | None = None

    def propose(self, seqs: list[tuple[object, list[int], int]]) -> list[list[int]]:
        """For each (key, tokens, k): at most k draft tokens continuing `tokens`."""
        raise NotImplementedError

    def release(self, key: object) -> None:
        """Forget the state kept for sequence `key`."""


class NgramDrafter(Drafter):
    """Prompt lookup over each sequence's own tokens (no state)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, seqs):
        c = self.config
        return [ngram_draft(tokens, k, c.ngram_max, c.ngram_min) if k > 0 else [] for _, tokens, k in seqs]


SHORT_CATCH_UP = 16  # a draft model's catch-up of at most this many tokens runs as one-token decode rows
# (a sequence back from k = 0 after probe_interval plain steps catches up ~probe_interval + 2 tokens)


@dataclass
class _DraftSeq:
    """A sequence's state in the draft model's cache: the tokens whose K/V it holds, its blocks."""

    cached: list[int]
    blocks: list[int]


class DraftModel(Drafter):
    """A draft engine decoding greedily over its own paged KV cache, batched over sequences.

    propose: per sequence, drop the cached tokens that are no longer a prefix of its tokens
    (rejected drafts), then one forward over every sequence's uncached tokens (its catch-up
    chunk) and k - 1 batched one-token decode steps; draft j is argmax of step j's logits.
    """

    def __init__(self, directory: str | Path, vocab_size: int, max_tokens: int, device: str = "cpu") -> None:
        from bestiary.core.runtime.engine import Engine
        from bestiary.core.runtime.executor import supports_block_reuse
        from bestiary.core.runtime.kv_cache import BlockAllocator, KVCache, blocks_for

        self.engine = Engine.load(directory, device=device)
        model = self.engine.model
        if model.config.vocab_size != vocab_size:
            raise BestiaryError(f"--draft_engine_dir {directory}: vocab_size {model.config.vocab_size}, "
                                f"expected the target's {vocab_size} (a draft engine needs the same tokenizer)")
        if not supports_block_reuse(model):
            raise BestiaryError(f"--draft_engine_dir {directory}: {model.config.architecture} needs its own "
                                "positions or mask; a draft model must be causal with positions 0, 1, ...")
        self.model, self.device = model, device
        self.block_size = self.engine.build.tokens_per_block
        self.max_seq_len = self.engine.max_seq_len
        num_blocks = blocks_for(max_tokens, self.block_size)
        self.kv = KVCache.for_model(model, num_blocks, self.block_size)
        self.allocator = BlockAllocator(num_blocks, self.block_size)
        self.seqs: dict[object, _DraftSeq] = {}

    def release(self, key: object) -> None:
        seq = self.seqs.pop(key, None)
        if seq is not None:
            self.allocator.free(seq.blocks)

    def _keep(self, seq: _DraftSeq, tokens: list[int]) -> None:
        """Truncate seq's cache to its longest prefix shared with `tokens` (freeing emptied blocks)."""
        from bestiary.core.runtime.kv_cache import blocks_for

        same = 0
        limit = min(len(seq.cached), len(tokens) - 1)  # the last token is always fed again
        while same < limit and seq.cached[same] == tokens[same]:
            same += 1
        del seq.cached[same:]
        keep = blocks_for(same, self.block_size)
        self.allocator.free(seq.blocks[keep:])
        del seq.blocks[keep:]

    def _fits(self, tokens: list[int], k: int) -> bool:
        """The draft engine can hold `tokens` and k - 1 drafts (its max_seq_len and pool)."""
        from bestiary.core.runtime.kv_cache import blocks_for

        length = len(tokens) + k - 1
        return length <= self.max_seq_len and blocks_for(length, self.block_size) <= self.allocator.num_blocks

    def _last_argmax(self, cached: list[int], new: list[list[int]], tables: list[list[int]]) -> list[int]:
        """Feed each sequence's `new` tokens after its `cached` ones; argmax of each one's last logits.

        Short catch-ups (at most SHORT_CATCH_UP tokens each) go in as one-token rows of a decode
        step (positions cached + i over the same table), which the compiled decode plan runs; an
        eager chunk of a quantized model dequantizes its weights, ~10x the cost of a plan row."""
        short = all(len(n) <= SHORT_CATCH_UP for n in new) and sum(map(len, new)) <= MAX_BATCH
        if short:
            lens = [1 for n in new for _ in n]
            ctx = [c + i for c, n in zip(cached, new) for i in range(len(n))]
            rows = [t for t, n in zip(tables, new) for _ in n]
        else:
            lens, ctx, rows = [len(n) for n in new], cached, tables
        meta = AttentionMetadata.build(lens, ctx, rows, self.block_size, device=self.device)
        ids = torch.tensor([t for n in new for t in n], device=self.device)
        best = self.model(ids, meta, self.kv).float().argmax(dim=-1).tolist()  # [rows]
        if short:
            ends = torch.tensor([len(n) for n in new]).cumsum(0) - 1
            best = [best[e] for e in ends.tolist()]
        return best

    @torch.inference_mode()
    def propose(self, seqs):
        from bestiary.core.runtime.kv_cache import blocks_for

        out: list[list[int]] = [[] for _ in seqs]
        live = []  # (index in seqs, state, tokens fed so far, k)
        for i, (key, tokens, k) in enumerate(seqs):
            seq = self.seqs.setdefault(key, _DraftSeq([], []))
            if k <= 0:
                continue
            self._keep(seq, tokens)
            if not self._fits(tokens, k):
                continue
            extra = blocks_for(len(tokens) + k - 1, self.block_size) - len(seq.blocks)
            if extra > self.allocator.num_free:
                continue  # the pool is busy with longer sequences: no draft this step
            seq.blocks += self.allocator.allocate(max(extra, 0))
            live.append((i, seq, list(tokens), k))
        new = [tokens[len(seq.cached) :] for _, seq, tokens, _ in live]  # catch-up chunks, then 1 token each
        timed: list[float] = []  # seconds of the steps that were draft steps (short catch-ups at most)
        for step in range(max((k for *_, k in live), default=0)):
            run = [(x, n) for x, n in zip(live, new) if step < x[3]]
            if not run:
                break
            started = time.perf_counter()
            best = self._last_argmax([len(x[1].cached) for x, _ in run], [n for _, n in run],
                                      [x[1].blocks for x, _ in run])
            if max(map(len, new)) <= SHORT_CATCH_UP:  # a prompt's catch-up is a prefill, not a draft step's cost
                timed.append(time.perf_counter() - started)
            for (x, n), token in zip(run, best):
                i, seq, _, _ = x
                seq.cached += n
                out[i].append(token)
            new = [[out[x[0]][-1]] for x in live]
        self.step_seconds = sum(timed) / len(timed) if timed else None
        return out


def make_drafter(config: SpeculativeConfig, vocab_size: int, max_tokens: int, device: str = "cpu") -> Drafter:
    """The drafter `config` names (a draft engine's pool holds `max_tokens` tokens)."""
    if config.method == "ngram":
        return NgramDrafter(config)
    assert config.draft_engine_dir is not None, "SpeculativeConfig refuses method draft without one"
    return DraftModel(config.draft_engine_dir, vocab_size, max_tokens, device)


class Speculator:
    """The executor's speculative part of a step: `draft` before the forward, `verify` after it.

    Eligible rows: plain requests (no TokenChooser, no beam search) decoding one token, in a step
    where every row decodes one token. A row with k drafts is followed by k `DraftRow`s, within
    max_num_tokens, max_verify_rows and the request's length (k <= max_len - len(tokens) - 1, so
    the drafts stay inside its KV reservation); rows earlier in the batch draft first.
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.stats = AcceptanceStats()  # every request so far
        self.adaptive = AdaptiveK(config.num_draft_tokens, config.probe_interval) if config.adaptive else None
        self.steps = 0  # all-decode steps seen
        # the previous step: (start, rows, drafting seconds, max k, the drafter's own seconds per draft step)
        self._last: tuple[float, int, float, int, float | None] | None = None

    @classmethod
    def for_executor(cls, config: SpeculativeConfig, executor: Executor) -> Speculator:
        """A speculator for `executor`'s model (refused for masks / positions a chunk cannot extend)."""
        from bestiary.core.runtime.executor import supports_block_reuse

        model, build = executor.model, executor.build
        if not supports_block_reuse(model):
            raise BestiaryError(f"--speculative {config.method}: {model.config.architecture} needs its own positions "
                                "or mask; speculative decoding needs a causal model with positions 0, 1, ...")
        max_tokens = executor.allocator.num_blocks * build.tokens_per_block + build.max_batch_size * config.num_draft_tokens
        return cls(config, make_drafter(config, model.config.vocab_size, max_tokens, executor.device))

    @staticmethod
    def eligible(req: Request) -> bool:
        plain = req.chooser is None or req.sampling.guided_only  # a guided request drafts too (its grammar checks)
        return plain and req.search is None and bool(req.output) and req.num_cached == len(req.tokens) - 1

    def _measure(self, now: float, decode_only: bool) -> None:
        """Book the previous step's cost (adaptive k): F(R) = its draft-to-draft seconds less its
        drafting, d = the drafter's mean draft step (a draft engine's, without a new prompt's catch-up;
        otherwise the drafting seconds / k). Only steps that were all-decode and are followed by one
        count (a prompt chunk or an idle executor between them is not a step's cost)."""
        last, self._last = self._last, None
        if self.adaptive is None or last is None or not decode_only:
            return
        start, rows, drafting, steps, per_step = last
        self.adaptive.costs.add_step(rows, now - start - drafting)
        if steps and (per_step is not None or not isinstance(self.drafter, DraftModel)):
            self.adaptive.costs.add_draft(per_step if per_step is not None else drafting / steps)

    def _ks(self, executor: Executor, work: list[Row]) -> list[tuple[int, Request, int]]:
        """(row index, request, k) of the rows that draft this step: k <= num_draft_tokens, the request's
        length left and the verification budget (rows earlier in the batch first); adaptive: its k."""
        rows = self.config.max_verify_rows or MAX_BATCH
        budget = min(executor.build.max_num_tokens, max(rows, len(work))) - len(work)
        adaptive = self.adaptive
        if adaptive is not None:
            adaptive.forget({r.id for r in executor.running})
            costs = adaptive.costs
            calibrate = costs.ready and costs.rows.get(len(work), (0.0, 0))[1] < 2 and self.steps % self.config.probe_interval == 0
        asks = []
        for i, (req, seq, n) in enumerate(work):
            if seq is req and n == 1 and self.eligible(req):
                k = min(self.config.num_draft_tokens, executor._max_len(req) - len(req.tokens) - 1, budget)
                if adaptive is not None:
                    k = 0 if calibrate else adaptive.choose(req.id, len(work), k)  # calibrate: F(B) unmeasured
                if k > 0:
                    asks.append((i, req, k))
                    budget -= k
        return asks

    def draft(self, executor: Executor, work: list[Row]) -> list[Row]:
        """`work` (request, sequence, new tokens) with each eligible decode row followed by its drafts
        as `DraftRow`s (req.draft holds them); k from `_ks`."""
        now = time.perf_counter()
        decode_only = all(n == 1 for *_, n in work)
        self._measure(now, decode_only)
        if not decode_only:
            return work  # a step with a prompt chunk runs eagerly: drafts only in all-decode steps
        self.steps += 1
        asks = self._ks(executor, work)
        if not asks:
            self._last = (now, len(work), 0.0, 0, None)
            return work
        self.drafter.step_seconds = None
        proposed = self.drafter.propose([(r.id, r.tokens, k) for _, r, k in asks])
        drafts = {i: grammar_prefix(r, list(tokens[:k])) for (i, r, k), tokens in zip(asks, proposed)}
        out: list[Row] = []
        for i, (req, seq, n) in enumerate(work):
            out.append((req, seq, n))
            req.draft = drafts.get(i, [])
            if req.draft:
                tokens, start = req.tokens + req.draft, req.num_cached
                out += [(req, DraftRow(tokens, start + j, req.blocks, req.prompt), 1) for j in range(1, len(req.draft) + 1)]
        self._last = (now, len(out), time.perf_counter() - now, max(k for *_, k in asks), self.drafter.step_seconds)
        return out

    def verify(self, executor: Executor, work: list[Row],
               logits: torch.Tensor) -> tuple[list[Row], torch.Tensor, list[tuple[Request, int]]]:
        """Fold each drafted request's rows (logits [1 + k, V] among logits [R, V]) into one
        (req, req, 0) row: accept or reject its drafts, roll back the rejected K/V.
        Returns (work, logits [B, V], (request, token) for every token emitted)."""
        if not any(isinstance(seq, DraftRow) for _, seq, _ in work):
            return work, logits, []
        out: list[Row] = []
        keep: list[int] = []
        produced: list[tuple[Request, int]] = []
        i = 0
        while i < len(work):
            req, seq, n = work[i]
            j = i + 1
            while j < len(work) and isinstance(work[j][1], DraftRow):
                j += 1
            if j == i + 1:
                out.append((req, seq, n))
                keep.append(i)
            else:
                rows = logits[i:j] if req.chooser is None else guided_rows(req, logits[i:j])  # [1 + k, V]
                tokens = accept_drafts(rows, req.draft, req.sampling, req.generator)  # _accept advances a grammar
                for s in (req.spec, self.stats):
                    s.add(AcceptanceStats(1, len(req.draft), len(tokens) - 1))
                if self.adaptive is not None:
                    self.adaptive.observe(req.id, len(req.draft), len(tokens) - 1)
                req.draft = []
                executor._accept(req, tokens, produced)
                out.append((req, req, 0))
                keep.append(j - 1)
            i = j
        return out, logits[keep], produced
