"""Beam search for one request, step by step, as HF transformers' `_beam_search` does it.

With W = beam_width, K = max(2, 1 + number of end ids) * W, one step on processed
log-probabilities lp [R, V] of the R running beams (R = 1 at the first step) is:

    acc[r, v]   = score[r] + lp[r, v]                      (float32, cumulative log prob)
    candidates  = top-K of acc over all (r, v)             (diversity: see below)
    hit[c]      = token of c is an end id, or the output ends with a stop word, or the length limit
    running     = top-W of acc[c] - 1e9 * hit[c]           (the W beams that go on)
    finished    = top-W of  old finished slots  and  acc[c] / generated_len ** length_penalty
                  for the candidates c among the first W that hit

and the search ends when every candidate hits (the length limit), when early_stopping is
True and W hypotheses are finished, or when the best running beam can no longer beat the
worst finished one (early_stopping False: at the current length; "never": at the longest
length when length_penalty > 0). The -1e9 masks are HF's, so the same logits give the same
hypotheses and scores.

beam_search_diversity_rate d > 0 (Li et al. 2016): each beam's candidates are ranked, and
the k-th best (k = 0, 1, ...) is selected by acc - d * k; the beam keeps its true acc.

The KV side (`fork_block_tables`): a child beam shares its parent's full blocks (reference
counts) and gets a copy of the parent's partially filled last block; the first child of a
parent takes the parent's table as it is, and parents with no child are freed first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bestiary.core.runtime.kv_cache import fork_table
from bestiary.core.runtime.logits_processors import LogitsPipeline, ProcessorState, ends_with_any

NEG = -1.0e9  # HF's "impossible" score


@dataclass
class Beam:
    """One running sequence of a beam search (its block table is the executor's business)."""

    prompt: list[int]
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    log_probs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    state: ProcessorState | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Hypothesis:
    """A finished beam: score = cum_log_prob / len(output_ids) ** length_penalty."""

    output_ids: list[int]
    score: float
    cum_log_prob: float
    log_probs: list[float]
    logits: list[torch.Tensor]
    finish_reason: str


class BeamSearch:
    """The beam search state of one request (batch size 1 of HF's vectorised algorithm)."""

    def __init__(self, config, prompt: list[int], end_ids: set[int], stop_words: list[list[int]],
                 pipeline: LogitsPipeline | None, max_new_tokens: int) -> None:
        self.config = config
        self.width = config.beam_width
        self.prompt = prompt
        self.end_ids = end_ids
        self.stop_words = stop_words
        self.pipeline = pipeline
        self.max_new_tokens = max_new_tokens
        self.keep = max(2, 1 + len(end_ids)) * self.width
        self.beams: list[Beam] = []  # running; empty before the first step
        self.scores = torch.zeros(1)  # [R] cumulative log probs of the running beams
        self.slots: list[Hypothesis | None] = [None] * self.width
        self.slot_scores = torch.full((self.width,), NEG)
        self.slot_finished = torch.zeros(self.width, dtype=torch.bool)
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    # --- one step --------------------------------------------------------------------------
    def log_probs(self, raw: torch.Tensor, states: list[ProcessorState | None]) -> torch.Tensor:
        """Processed log-probabilities [R, V] of raw logits [R, V]: bias, log_softmax, penalties."""
        x = raw.float()
        if self.pipeline is not None:
            x = self.pipeline.bias(x)
        lp = torch.log_softmax(x, dim=-1)
        if self.pipeline is not None:
            present = [s for s in states if s is not None]
            assert len(present) == len(states), "with processors, every beam has a state (step gives the root one)"
            lp = self.pipeline.penalize(lp, present)
        return lp

    def candidates(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-K of acc [R, V]: (acc values [K], flat indices [K], selection values [K], descending).

        The selection values are acc itself, or acc - rate * (rank within its beam) with diversity."""
        rate = self.config.beam_search_diversity_rate
        if rate == 0.0:
            values, flat = torch.topk(acc.reshape(-1), k=self.keep)
            return values, flat, values
        k = min(self.keep, acc.shape[1])
        values, tokens = torch.topk(acc, k=k, dim=-1)  # [R, k], each beam's best first
        penalised = values - rate * torch.arange(k, dtype=values.dtype)  # [R, k]
        select, chosen = torch.topk(penalised.reshape(-1), k=self.keep)
        flat = (chosen // k) * acc.shape[1] + tokens.reshape(-1)[chosen]
        return values.reshape(-1)[chosen], flat, select

    def step(self, raw: torch.Tensor, root: Beam | None = None) -> list[int]:
        """Advance on the raw logits [R, V] of the running beams (or, first, of the prompt's last
        token: R = 1, `root` a Beam with the prompt's block table and no output).

        Returns the parent index (into the previous running beams, or 0 for the root) of each of
        the W new running beams; `self.beams` then holds them (blocks left to the caller).
        """
        if self.beams:
            parents_seq = self.beams
        elif root is None:
            raise ValueError("the first beam search step needs `root`, the prompt's Beam")
        else:
            parents_seq = [root]
            if self.pipeline is not None:
                root.state = self.pipeline.new_state(self.prompt)
        lp = self.log_probs(raw, [b.state for b in parents_seq])  # [R, V]
        vocab = lp.shape[1]
        acc = lp + self.scores[:, None]  # [R, V]
        top, flat, select = self.candidates(acc)  # [K] each
        parent, token = (flat // vocab).tolist(), (flat % vocab).tolist()
        generated = len(parents_seq[0].output) + 1
        at_limit = generated >= self.max_new_tokens
        reasons = [self._hit(parents_seq[p].output, t, generated, at_limit) for p, t in zip(parent, token)]
        hit = torch.tensor([r is not None for r in reasons])  # [K]

        running = top + hit.float() * NEG
        order = torch.topk(select + hit.float() * NEG, k=self.width).indices.tolist()
        self._update_finished(top, hit, generated, parents_seq, parent, token, lp, raw, reasons)

        # a parent's first child takes its processor state; the others fork it before any push
        states, taken = [], set()
        for c in order:
            src = parents_seq[parent[c]]
            states.append(None if src.state is None else src.state.fork() if parent[c] in taken else src.state)
            taken.add(parent[c])
        new_beams = []
        for c, state in zip(order, states):
            p, t = parent[c], token[c]
            if state is not None:
                state.push(t)
            new_beams.append(self._child(parents_seq[p], t, float(lp[p, t]), raw[p], state))
        self.beams = new_beams
        self.scores = running[order].clone()
        self._check_done(hit, generated)
        return [parent[c] for c in order]

    def _hit(self, output: list[int], token: int, generated: int, at_limit: bool) -> str | None:
        """Why the candidate output + [token] ends ("stop" / "length"), or None."""
        if token in self.end_ids:
            return "stop"
        if self.stop_words and generated >= self.config.min_length and ends_with_any(output + [token], self.stop_words):
            return "stop"
        return "length" if at_limit else None

    def _child(self, src: Beam, token: int, log_prob: float, raw_row: torch.Tensor, state) -> Beam:
        logits = src.logits + [raw_row.float().clone()] if self.config.output_generation_logits else []
        return Beam(self.prompt, src.output + [token], num_cached=src.num_cached,
                    log_probs=src.log_probs + [log_prob], logits=logits, state=state)

    def _update_finished(self, top, hit, generated, parents_seq, parent, token, lp, raw, reasons) -> None:
        """HF's _update_finished_beams: merge the finished top-W candidates into the W slots."""
        in_top = torch.arange(self.keep) < self.width
        just = hit & in_top  # [K]
        scores = top / (generated ** self.config.length_penalty)
        if bool(self.slot_finished.all()) and self.config.early_stopping is True:
            scores = scores + NEG
        if not self.improvable:
            scores = scores + NEG
        scores = scores + (~just).float() * NEG
        merged = torch.cat([self.slot_scores, scores])  # [W + K]
        pick = torch.topk(merged, k=self.width).indices.tolist()
        slots, finished = [], []
        for i in pick:
            if i < self.width:
                slots.append(self.slots[i])
                finished.append(bool(self.slot_finished[i]))
                continue
            c = i - self.width
            if bool(just[c]):
                src, p, t = parents_seq[parent[c]], parent[c], token[c]
                logits = src.logits + [raw[p].float().clone()] if self.config.output_generation_logits else []
                slots.append(Hypothesis(src.output + [t], float(merged[i]), float(top[c]),
                                        src.log_probs + [float(lp[p, t])], logits, reasons[c]))
            else:
                slots.append(None)
            finished.append(bool(just[c]))
        self.slots = slots
        self.slot_scores = merged[pick].clone()
        self.slot_finished = torch.tensor(finished)

    def _check_done(self, hit: torch.Tensor, generated: int) -> None:
        """HF's early-stop heuristic and _beam_search_has_unfinished_sequences."""
        lp_exp = self.config.length_penalty
        if self.config.early_stopping == "never" and lp_exp > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = generated
        best_running = self.scores[0] / (best_len ** lp_exp)
        worst = torch.where(self.slot_finished, self.slot_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_running > worst).any())
        open_beam = not (bool(self.slot_finished.all()) and self.config.early_stopping is True)
        self.done = not (self.improvable and open_beam and not bool(hit.all()))

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best score first."""
        return [h for h, f in zip(self.slots, self.slot_finished.tolist()) if f and h is not None]


def fork_block_tables(allocator, kv, old: list, parents: list[int], children: list[Beam], block_size: int) -> tuple[int, int]:
    """Give each child beam a block table from its parent in `old` (objects with .blocks, .num_cached).

    Parents without a child are freed first; a parent's first child takes its table; each
    further child shares the parent's full blocks and gets a fresh copy of the partial last
    block (K and V of every layer). Returns (blocks allocated, blocks released to the pool).
    """
    wanted = set(parents)
    before = allocator.num_used
    for i, seq in enumerate(old):
        if i not in wanted:
            allocator.free(seq.blocks)
            seq.blocks = []
    released = before - allocator.num_used
    allocated, taken = 0, set()
    for child, p in zip(children, parents):
        src = old[p]
        if p not in taken:
            taken.add(p)
            child.blocks = src.blocks
            continue
        child.blocks, copied = fork_table(allocator, kv, src.blocks, src.num_cached, block_size)
        allocated += copied
    return allocated, released
