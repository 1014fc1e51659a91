"""The executor: in-flight batching over a paged KV cache.

Each `step()`:
  1. admits waiting requests (FCFS) while the batch has room and the KV pool can promise
     each one the blocks of its whole (prompt + max_new_tokens) length; a request first
     takes the cached blocks of its longest already-computed prefix (block reuse) and
     needs pool space only for the rest;
  2. packs one chunk of work per running request, within max_num_tokens: the rest of a
     prompt (chunked prefill) or the one token to decode;
  3. runs the model once over the packed tokens and samples a token for every request
     whose prompt is fully in the cache;
  4. retires finished requests and frees their blocks (full blocks stay cached for reuse).

n > 1 samples of one prompt: the request computes the prompt once; its n - 1 siblings wait,
parked, until the prompt is in the cache, then fork its block table (full blocks shared,
the partial last block copied) and sample their first tokens from the same logits row.
Followers (`add(after=...)`, requests whose prompts extend a queued request's: the continuations
of one context) wait the same way, fork the same table, then compute the rest of their own prompts.

Speculative decoding (core.runtime.speculative, Executor(speculative=...)): in an all-decode
step, step 2 follows each plain decoding row with its k draft tokens as one-token rows over
the same block table; after step 3's forward, `Speculator.verify` accepts a prefix of the
drafts, appends them and one more token, and rolls the request's K/V back to what it kept.

Structured output (core.runtime.guided): a guided request's chooser holds a grammar matcher; the
masks of a step's guided rows are filled on a helper thread while step 3's forward runs.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels.attention_window import blocks_held_at_most, releasable_blocks
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.lora.adapter import LoraAdapter
from bestiary.core.lora.batch import AdapterStack, StepLora
from bestiary.core.runtime.beam import Beam, BeamSearch, fork_block_tables
from bestiary.core.runtime.guided import GrammarBackends, GrammarMatcher, MaskFill, apply_bitmask
from bestiary.core.runtime.kv_cache import (
    BlockAllocator,
    BlockKey,
    KVCache,
    KvCacheConfig,
    blocks_for,
    check_pool_fits,
    fork_table,
    pool_tokens,
    truncate_table,
)
from bestiary.core.runtime.kv_window import held, release_outside, release_window, request_window
from bestiary.core.runtime.logits_processors import LogitsPipeline, ends_with_any
from bestiary.core.runtime.model import DecoderLM
from bestiary.core.runtime.plugin_processors import ProcessorResolver, resolver_for
from bestiary.core.runtime.pooling import Pooling, accumulate, pooled_embedding
from bestiary.core.runtime.sampling import SamplingConfig, TokenChooser, make_generator, sample
from bestiary.core.runtime.speculative import AcceptanceStats, DraftRow, SpeculativeConfig, Speculator
from bestiary.core.runtime.threads import ThreadGovernor

if TYPE_CHECKING:
    from bestiary.core.lora.cache import LoraCache

_ids = itertools.count()
LORA_STACKS = 8  # stacked adapter sets kept (a step's set is usually the previous step's)


def supports_block_reuse(model: DecoderLM) -> bool:
    """True when a token's K/V depend only on the tokens before it: a causal mask and the
    default positions (prefix-LM masks and 2D positions see the whole prompt)."""
    return model.mask_kind == "causal" and type(model).position_ids is DecoderLM.position_ids


def longrope_switch(model: DecoderLM) -> int | None:
    """The length past which a LongRoPE rotary (core.layers.longrope) switches to its long frequencies, or None
    without one. A block's K/V then depend on the length of the sequence that computed it: no block is reused."""
    for module in model.modules():
        longrope = getattr(module, "longrope", None)
        if longrope is not None:
            return int(longrope.original)
    return None


@dataclass
class Request:
    """One generation request and its state."""

    prompt: list[int]
    sampling: SamplingConfig
    stop_ids: set[int]
    generator: torch.Generator  # the request's own draws (core.runtime.sampling.make_generator)
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    reserved: int = 0  # blocks promised but not yet allocated
    block_keys: list[BlockKey] = field(default_factory=list)  # content keys of the full blocks so far
    reuse_prefix: bool = True  # False: compute every prompt token (e.g. when context logits are wanted)
    finish_reason: str | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    chooser: TokenChooser | None = None  # None: the batched fast path (plain sampling / greedy)
    search: BeamSearch | None = None  # beam_width > 1
    context_logits: list[torch.Tensor] = field(default_factory=list)  # [n, V] float32 per prefill chunk
    lora: LoraAdapter | None = None  # the request's adapter (core.lora), None: the base model
    lora_held: bool = False  # this sequence holds its adapter in the LoRA cache until it ends
    index: int = 0  # which of the prompt's n samples this is
    siblings: list[Request] = field(default_factory=list)  # samples 1..n-1 (on sample 0 only)
    followers: list[Request] = field(default_factory=list)  # requests extending this prompt (Executor.add(after=))
    forked: bool = False  # the siblings have taken the prompt's blocks
    window: int = 0  # attention window and sinks (core.runtime.kv_window; 0: none)
    sinks: int = 0
    release_window: int = 0  # blocks past this window are released (0: none are)
    draft: list[int] = field(default_factory=list)  # this step's draft tokens (speculative decoding)
    spec: AcceptanceStats = field(default_factory=AcceptanceStats)  # its speculative steps so far
    pooling: Pooling | None = None  # an embedding request (core.runtime.pooling): ends "embedded" after its prompt
    pooled: torch.Tensor | None = None  # its pooling state, then (finished) its embedding [H] float32

    @property
    def group(self) -> list[Request]:
        """Every sequence that starts from this prompt: this request, its siblings and its followers."""
        return [self, *self.siblings, *self.followers]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# A step's row of work: (request, the sequence that runs, its new tokens). The sequence is the
# request itself, one of its beams, or (speculative decoding, until verify folds them) a draft.
Seq = Request | Beam | DraftRow
Row = tuple[Request, Seq, int]


class Executor:
    """Runs requests on one model rank with in-flight batching."""

    def __init__(self, model, build, device: str = "cpu", kv_cache_config: KvCacheConfig | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.build = build
        self.device = device
        kv_config = kv_cache_config or KvCacheConfig()
        default = build.max_tokens_in_paged_kv_cache or build.max_batch_size * build.max_seq_len
        tokens = pool_tokens(default, kv_config, KVCache.bytes_per_token_for(model), device)
        check_pool_fits(tokens, KVCache.bytes_per_token_for(model), device)
        num_blocks = blocks_for(tokens, build.tokens_per_block)
        self.kv = KVCache.for_model(model, num_blocks, build.tokens_per_block)
        # Reuse needs K/V that depend on the prefix only: causal masks and positions 0, 1, ...
        self.switch = longrope_switch(model)  # LongRoPE: a sequence crossing it is recomputed (_recomputes)
        self.reuse = kv_config.enable_block_reuse and supports_block_reuse(model) and self.switch is None
        self.can_fork = supports_block_reuse(model) and self.switch is None  # followers (add(after=)) may fork a prompt
        self.allocator = BlockAllocator(num_blocks, build.tokens_per_block, enable_reuse=self.reuse)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._lora_stacks: dict[tuple, AdapterStack] = {}  # (name, uid) of each adapter -> stacked weights
        self._lora_roots: dict[str | tuple, BlockKey] = {}  # adapter name (, window, sinks) -> root key
        self.lora_cache: LoraCache | None = None  # sequences hold their adapter's id until they end
        self.grammars: GrammarBackends | None = None  # structured output: set by LLM from the engine's tokenizer
        self.governor: ThreadGovernor | None = None  # threads that follow a shared CPU (core.runtime.threads)
        self.processors: ProcessorResolver | None = None  # plugins' logits processors: set by LLM (its registry)
        self._masks = MaskFill()
        self.speculator = Speculator.for_executor(speculative, self) if speculative else None

    # --- requests ----------------------------------------------------------------------
    def add(self, prompt: list[int], sampling: SamplingConfig, stop_ids: set[int] | None = None,
            lora: LoraAdapter | None = None, pooling: Pooling | None = None,
            reuse_prefix: bool | None = None, after: Request | None = None) -> Request:
        """Queue a request (with a LoRA adapter, or None: the base model); prompt and length limits are checked here.

        With `pooling`, an embedding request: its prompt is computed (batched with the other requests'
        work) and pooled; it ends "embedded" with `pooled` = the pooled hidden state [H] (not normalised),
        generating nothing. `reuse_prefix` overrides whether the request may start from cached prefix blocks
        (context logits and mean pooling turn it off): True with context logits gives the logits of the
        computed rows only, [P - s, V] after s reused tokens (scoring a continuation: core.bench.loglikelihood).

        `after`: a queued request whose prompt this one's extends (n 1, no beams or pooling). This request
        waits, parked, until that prompt is computed, then forks its blocks (full blocks shared, the partial
        last one copied) and computes the rest of its own prompt; it takes room in `after`'s batch and KV
        reservation and ends with `after` if that ends first (core.bench.loglikelihood: the continuations of
        one context)."""
        b = self.build
        if pooling is not None and (self.model.pp_size > 1 or sampling.n > 1 or sampling.is_beam_search):
            raise BestiaryError("embeddings need pp_size 1 (the last stage holds the hidden states), n 1, no beams")
        if not prompt:
            raise BestiaryError("empty prompt: at least one input token is needed")
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if bad or not isinstance(prompt, list):
            raise BestiaryError(f"input id {bad[0] if bad else prompt!r}: expected a list of integer token ids")
        if len(prompt) > b.max_input_len:
            raise BestiaryError(f"prompt of {len(prompt)} tokens exceeds the engine's max_input_len {b.max_input_len}")
        vocab = self.model.config.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise BestiaryError(f"input id {max(prompt) if max(prompt) >= vocab else min(prompt)} is outside the vocabulary [0, {vocab})")
        stops = set(stop_ids or ())
        if sampling.end_id is not None:
            stops = {sampling.end_id}
        if sampling.beam_width > b.max_num_tokens:
            raise BestiaryError(f"beam_width {sampling.beam_width} exceeds the engine's max_num_tokens {b.max_num_tokens}")
        if sampling.n > b.max_batch_size:
            raise BestiaryError(f"n {sampling.n} exceeds the engine's max_batch_size {b.max_batch_size}")
        seed = sampling.random_seed
        group = [Request(list(prompt), sampling, set() if sampling.ignore_eos else stops,
                         make_generator(None if seed is None else seed + i), index=i) for i in range(sampling.n)]
        for member in group:
            self._prepare_sampling(member, vocab)
        req = group[0]
        req.siblings = group[1:]
        req.pooling = pooling
        req.reuse_prefix = req.reuse_prefix and pooling != "mean"  # mean pools every prompt token's row
        if reuse_prefix is not None:
            req.reuse_prefix = reuse_prefix
        window, sinks = request_window(sampling, self.build)
        released = release_window(self.model.attention_windows, window, sinks)
        for member in group:
            member.lora = lora
            member.window, member.sinks = window, sinks
            member.release_window = released if self._width(req) == 1 else 0  # beams / samples keep their blocks
        if after is not None:
            self._attach(after, req)
        elif self._need_blocks(req) > self.allocator.num_blocks:
            raise BestiaryError(f"request of {self._max_len(req)} tokens x {self._width(req)} sequences "
                                "does not fit the KV cache")
        if lora is not None and self.lora_cache is not None:  # the caller took one hold; one per sample
            for member in group:
                member.lora_held = True
            for _ in group[1:]:
                self.lora_cache.acquire(lora)
        if after is None:
            self.waiting.append(req)
        return req

    def _attach(self, after: Request, req: Request) -> None:
        """Park `req` as a follower of the queued request `after` (add(after=...)): it forks `after`'s
        computed prompt (`_fork_samples`), so that prompt's K/V must not depend on what follows it."""
        n = len(after.prompt)
        if not self.can_fork:
            raise BestiaryError("after=: this model's prompt K/V depend on the tokens after them (a prefix-LM mask, "
                                "2D or LongRoPE positions): a follower cannot fork them")
        if not any(r is after for r in self.waiting):
            raise BestiaryError("after=: that request is no longer queued (its prompt is computing or computed)")
        if len(req.prompt) <= n or req.prompt[:n] != after.prompt:
            raise BestiaryError(f"after=: the prompt must extend that request's prompt of {n} tokens")
        if (req.siblings or req.search is not None or req.pooling is not None or after.search is not None
                or after.pooling is not None or req.lora is not after.lora
                or (req.window, req.sinks) != (after.window, after.sinks)):
            raise BestiaryError("after=: expected n 1, no beams or pooling, and the LoRA adapter and attention "
                                "window of that request")
        if len(after.group) >= self.build.max_batch_size:
            raise BestiaryError(f"after=: that request already starts {len(after.group)} sequences, the engine's "
                                f"max_batch_size {self.build.max_batch_size}")
        after.followers.append(req)
        if self._need_blocks(after) > self.allocator.num_blocks:
            after.followers.pop()
            raise BestiaryError(f"request of {len(req.prompt)} tokens with {len(after.group)} sequences sharing "
                                f"its first {n} does not fit the KV cache")
        for member in after.group:
            member.release_window = 0  # forked blocks: none is released

    def _prepare_sampling(self, req: Request, vocab: int) -> None:
        """Stop words, processors and the chooser / beam search a request asked for."""
        s = req.sampling
        try:
            req.stop_words = s.token_words("stop_words")
            for name, words in (("stop_words", req.stop_words), ("bad_words", s.token_words("bad_words"))):
                bad = [t for w in words for t in w if t >= vocab]
                if bad:
                    raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
            for name in ("end_id", "pad_id", "top_p_reset_ids"):
                if (getattr(s, name) or 0) >= vocab:
                    raise ValueError(f"{name} {getattr(s, name)} is outside the vocabulary [0, {vocab})")
            pipeline = LogitsPipeline(s, vocab, req.stop_ids) if LogitsPipeline.wanted(s) else None
        except ValueError as err:
            raise BestiaryError(f"sampling: {err}") from None
        if s.output_context_logits:
            req.reuse_prefix = False  # every prompt position must be computed
        if s.is_beam_search:
            req.search = BeamSearch(s, req.prompt, req.stop_ids, req.stop_words, pipeline,
                                    self._max_len(req) - len(req.prompt))
        elif s.needs_chooser:
            plugins = resolver_for(self.processors, vocab).build(s.logits_processors, req.prompt) \
                if s.logits_processors else None
            req.chooser = TokenChooser(s, req.generator, pipeline, req.prompt, self._matcher(s), plugins)

    def _matcher(self, s: SamplingConfig) -> GrammarMatcher | None:
        """A guided request's grammar matcher (compiled here: a bad constraint is refused by `add`)."""
        if s.guided is None:
            return None
        if self.grammars is None:
            raise BestiaryError(f"guided {s.guided.kind}: structured output needs the engine's tokenizer "
                                "(this engine has none, or the executor was made without LLM)")
        return self.grammars.matcher(s.guided)

    def _max_len(self, req: Request) -> int:
        return min(len(req.prompt) + req.sampling.max_new_tokens, self.build.max_seq_len)

    @staticmethod
    def _width(req: Request) -> int:
        """Sequences the request may run at once: its beams or its n samples."""
        return max(req.sampling.beam_width, req.sampling.n)

    def _own_blocks(self, req: Request, member: Request | None = None) -> int:
        """Blocks one sequence of `req` (or `member`, a sample or follower of it) holds at most beyond
        the prompt's full (shared) blocks."""
        bs = self.build.tokens_per_block
        return blocks_for(self._max_len(member or req), bs) - len(req.prompt) // bs

    def _need_blocks(self, req: Request) -> int:
        """Most blocks `req` can hold at once: beams (or samples) share the prompt's full
        blocks and hold at most the rest of the length each. Under a window whose blocks are
        released (core.runtime.kv_window), at most the window's blocks for the largest step."""
        bs = self.build.tokens_per_block
        whole = (len(req.prompt) // bs + self._width(req) * self._own_blocks(req)
                 + sum(self._own_blocks(req, f) for f in req.followers))
        if not req.release_window:
            return whole
        speculator = getattr(self, "speculator", None)
        step = max(min(self.build.max_num_tokens, len(req.prompt)),
                   1 + (speculator.config.num_draft_tokens if speculator is not None else 0))
        return min(whole, blocks_held_at_most(req.release_window, req.sinks, step, bs))

    def cancel(self, req: Request) -> None:
        """Stop a request (every sample of it) now; its blocks go back to the pool."""
        if req in self.waiting:
            self.waiting.remove(req)
        for member in req.group:
            self._finish(member, "cancelled")

    def stop(self, req: Request) -> None:
        """End one sequence now as "stop" (its caller found a stop string in its text); blocks go back."""
        self._finish(req, "stop")

    def _finish(self, req: Request, reason: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = reason
        if req.lora_held:
            req.lora_held = False
            assert self.lora_cache is not None and req.lora is not None, "only `add` holds, from the LoRA cache"
            self.lora_cache.release(req.lora)
        if not req.forked:  # parked siblings end with the request that would have forked them
            req.forked = True
            for sibling in req.siblings + req.followers:
                self._finish(sibling, reason)
        if req in self.running:
            self.running.remove(req)
        self.allocator.free(held(req.blocks))
        if req.search is not None:
            for beam in req.search.beams:
                self.allocator.free(beam.blocks)
                beam.blocks = []
        self.allocator.reserved -= req.reserved
        req.blocks, req.reserved = [], 0
        if self.speculator is not None:
            self.speculator.drafter.release(req.id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def peak_kv_bytes(self) -> int:
        """Most K/V bytes held by referenced blocks at any time so far."""
        return self.allocator.peak_used * self.kv.bytes_per_block

    def check_kv_accounting(self) -> None:
        """Invariant for tests: a request's table covers exactly its cached tokens, a windowed one
        holds no more blocks than its window's, and the pool's blocks in use never exceed the
        blocks the running requests hold."""
        bs, bound = self.build.tokens_per_block, 0
        for req in self.running:
            for seq in req.search.beams if req.search is not None and req.search.beams else [req]:
                if len(seq.blocks) != blocks_for(seq.num_cached, bs):
                    raise AssertionError(f"request {req.id} holds {len(seq.blocks)} blocks for {seq.num_cached} tokens")
                holding = len(held(seq.blocks))
                if req.release_window and holding > self._need_blocks(req):
                    raise AssertionError(f"request {req.id} holds {holding} blocks, more than its window's "
                                         f"{self._need_blocks(req)}")
                bound += holding
        if self.allocator.num_used > bound:
            raise AssertionError(f"{self.allocator.num_used} KV blocks in use for {bound} blocks of tokens")

    # --- one step ----------------------------------------------------------------------
    def _admit(self) -> None:
        """Admit FCFS while the batch has room and the pool can promise each request's whole length.

        A request reuses the cached blocks of its prompt's longest computed prefix, but never
        its last two prompt tokens (the last one's logits are needed; a lone prompt token would run as
        a decode row, which sums differently from a prefill: batch invariance, docs/runtime.md).
        Already-referenced hits cost no pool
        space; hits on evictable blocks and the blocks still to compute are reserved, so every
        admitted request can finish: free + evictable - reserved >= 0 holds at all times.
        """
        bs = self.build.tokens_per_block
        while self.waiting and len(self.running) < self.build.max_batch_size:
            req = self.waiting[0]
            if self.running and len(self.running) + len(req.group) > self.build.max_batch_size:
                break  # its n samples need room in the batch
            need = self._need_blocks(req)
            queried = max(0, len(req.prompt) - 2) // bs if self.reuse and req.reuse_prefix else 0
            keys, hits = self.allocator.lookup(req.prompt, queried, self._lora_root(req))
            outside = releasable_blocks(len(hits) * bs, req.release_window, req.sinks, bs)  # hits past the window
            kept = [h for i, h in enumerate(hits) if i not in outside]
            if not self.allocator.can_reserve(need - self.allocator.shared(kept)):
                break
            self.waiting.popleft()
            if queried:
                self.allocator.acquire(hits, queried)
            req.blocks, req.block_keys, req.num_cached = hits, keys, len(hits) * bs
            release_outside(self.allocator, req.blocks, req.num_cached, req.release_window, req.sinks, bs)
            req.reserved = need - len(kept)
            self.allocator.reserved += req.reserved
            self.running.append(req)

    def _lora_root(self, req: Request) -> BlockKey | None:
        """The parent of a request's first block: None for the base model, the adapter's own key
        otherwise (K/V computed with an adapter are reused only by requests with the same one),
        under a key of the request's window and sinks when it has its own (they change K/V too)."""
        lora = None if req.lora is None else ("lora", req.lora.name, req.lora.uid)  # a re-read adapter: new K/V
        root = None if lora is None else self._lora_roots.setdefault(lora, BlockKey(None, lora))
        if not (req.window or req.sinks):
            return root
        name = (lora, req.window, req.sinks)
        return self._lora_roots.setdefault(name, BlockKey(root, ("window", req.window, req.sinks)))

    def _step_lora(self, work: list[Row]) -> StepLora | None:
        """The step's LoRA (meta.lora): its adapters stacked (cached per set of names), a slot per sequence."""
        adapters = {r.lora.name: r.lora for r, _, _ in work if r.lora is not None}
        if not adapters:
            return None
        names = tuple(sorted(adapters))
        key = tuple((n, adapters[n].uid) for n in names)  # a re-read adapter is another stack
        stack = self._lora_stacks.pop(key, None) or AdapterStack([adapters[n] for n in names], self.model.dtype,
                                                                  self.device)
        self._lora_stacks[key] = stack  # most recent last
        while len(self._lora_stacks) > LORA_STACKS:
            self._lora_stacks.pop(next(iter(self._lora_stacks)))
        slots = [names.index(r.lora.name) if r.lora is not None else -1 for r, _, _ in work]
        return StepLora(stack, [n for *_, n in work], slots)

    def _cache_full_blocks(self, req: Request) -> None:
        """Register the blocks of `req` that have just filled (their K/V are all computed)."""
        bs, tokens = self.build.tokens_per_block, req.tokens
        for b in range(len(req.block_keys), req.num_cached // bs):
            parent = req.block_keys[-1] if req.block_keys else self._lora_root(req)
            key = BlockKey(parent, tuple(tokens[b * bs : (b + 1) * bs]))
            req.block_keys.append(self.allocator.register(req.blocks[b], key))

    def _grow(self, req: Request, seq: Seq, tokens: int) -> None:
        """Make sure seq (req or one of its beams) owns blocks for `tokens` tokens (from req's reservation)."""
        extra = blocks_for(tokens, self.build.tokens_per_block) - len(seq.blocks)
        if extra > 0:
            seq.blocks += self.allocator.allocate(extra)
            req.reserved -= extra
            self.allocator.reserved -= extra

    def _release_outside_window(self, req: Request) -> None:
        """Give the blocks no later query of `req` sees back to the pool (core.runtime.kv_window);
        they return to the request's reservation, which bounds what it holds at once."""
        released = release_outside(self.allocator, req.blocks, req.num_cached, req.release_window, req.sinks,
                                   self.build.tokens_per_block)
        req.reserved += released
        self.allocator.reserved += released

    def _fork_samples(self, req: Request) -> None:
        """Start req's parked siblings and followers from its computed prompt: each shares the full
        blocks, copies the partial last one and takes its own part of req's reservation."""
        for sib in req.siblings + req.followers:
            own = self._own_blocks(req, sib)
            sib.blocks, copied = fork_table(self.allocator, self.kv, req.blocks, req.num_cached,
                                            self.build.tokens_per_block)
            req.reserved -= own
            sib.reserved = own - copied
            self.allocator.reserved -= copied
            sib.num_cached, sib.block_keys = req.num_cached, list(req.block_keys)
            self.running.append(sib)
        req.forked = True

    def _schedule(self) -> list[Row]:
        """(request, sequence, number of new tokens) for this step, within max_num_tokens.

        The sequence is the request itself, or each of its running beams (all or none)."""
        budget = self.build.max_num_tokens
        work: list[Row] = []
        for req in sorted(self.running, key=lambda r: r.num_cached < len(r.prompt)):  # decodes first
            if req.search is not None and req.search.beams:
                if budget >= len(req.search.beams):
                    work += [(req, beam, 1) for beam in req.search.beams]
                    budget -= len(req.search.beams)
                continue
            if self._recomputes(req, budget):
                req.num_cached = 0  # every token again, with LongRoPE's long frequencies
            n = min(len(req.tokens) - req.num_cached, budget)
            if n <= 0:
                continue
            work.append((req, req, n))
            budget -= n
        return work

    def _recomputes(self, req: Request, budget: int) -> bool:
        """True when this step takes `req` past a LongRoPE switch length o (core.layers.longrope) while its
        cached K/V were computed at a length within o (short frequencies): like transformers' Phi-3 `generate`,
        the whole sequence is then computed again in this step, with the long ones. Only for a lone sample
        (no forked or released blocks, no context logits or pooling) that fits the step's budget; otherwise its
        cache keeps the short keys, as transformers' forward over a cache does."""
        o = self.switch
        return (o is not None and 0 < req.num_cached <= o < len(req.tokens) <= budget and req.sampling.n == 1
                and not req.release_window and not req.sampling.output_context_logits and req.pooling is None)

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, int]]:
        """Run one step; returns (request, new token) for every request that produced one
        (a beam search request: every token of its best beam, once, when it finishes)."""
        if self.governor is not None:
            self.governor.tick()
        self._admit()
        work = self._schedule()
        if not work:
            return []
        if self.speculator is not None:  # a drafted decode row -> 1 + k one-token rows (verify folds them back)
            work = self.speculator.draft(self, work)
        ids: list[int] = []
        for req, seq, n in work:
            self._grow(req, seq, seq.num_cached + n)
            ids += seq.tokens[seq.num_cached : seq.num_cached + n]
        meta = AttentionMetadata.build(
            [n for *_, n in work], [s.num_cached for _, s, _ in work], [s.blocks for _, s, _ in work],
            self.build.tokens_per_block, positions=self._positions(work), device=self.device,
            mask=self.model.mask_kind,
            prefix_lens=[self.model.prefix_len(s.prompt) for _, s, _ in work] if self.model.mask_kind != "causal" else None,
        )
        meta.lora = self._step_lora(work)
        if any(r.window or r.sinks for r, _, _ in work):  # per-sequence windows (the layers narrow them)
            meta.windows, meta.sinks = [r.window for r, _, _ in work], [r.sinks for r, _, _ in work]
        context = [r.sampling.output_context_logits and s is r and r.num_cached < len(r.prompt) for r, s, _ in work]
        pooled = [r.pooling is not None and s is r for r, s, _ in work]
        meta.keep_hidden = any(pooled)
        masks = self._start_masks(work)  # filled while the forward runs
        logits = self.model(torch.tensor(ids, device=self.device), meta, self.kv, all_logits=any(context + pooled))
        if any(context + pooled):  # logits [T, V]: keep the prompt rows of the requests that asked
            offsets = [0] + torch.tensor([n for *_, n in work]).cumsum(0).tolist()
            for i, (req, _, n) in enumerate(work):
                if context[i]:
                    req.context_logits.append(logits[offsets[i] : offsets[i] + n].float().clone())
                if pooled[i] and req.pooling is not None and meta.hidden is not None:
                    req.pooled = accumulate(req.pooled, meta.hidden[offsets[i] : offsets[i] + n], req.pooling)
            logits = logits.index_select(0, meta.last_token_index)  # [B, V]
        produced: list[tuple[Request, int]] = []
        if self.speculator is not None:  # drafted rows: accepted, rolled back and done as (req, req, 0)
            work, logits, produced = self.speculator.verify(self, work, logits)
        ready = []
        for i, (req, seq, n) in enumerate(work):
            seq.num_cached += n
            if seq is req and self.reuse and req.num_cached >= (len(req.block_keys) + 1) * self.build.tokens_per_block:
                self._cache_full_blocks(req)
            if seq.num_cached == len(seq.tokens):
                ready.append(i)
        for req, seq, _ in work:
            if seq is req and req.release_window and not req.finished:
                self._release_outside_window(req)
        ready = self._finish_embeddings(work, ready)
        forks = [i for i in ready if len(work[i][0].group) > 1 and not work[i][0].forked]
        for i in forks:  # the siblings sample their first tokens from their request's row (followers compute on)
            self._fork_samples(work[i][0])
            ready += range(len(work), len(work) + len(work[i][0].siblings))
            work += [(sib, sib, 0) for sib in work[i][0].siblings]
        rows = [i for i in forks for _ in work[i][0].siblings]
        if rows:
            logits = torch.cat([logits, logits[rows]])  # [B + forked siblings, V]
        return produced + (self._choose(work, ready, logits, self._masks_of(masks)) if ready else [])

    def _start_masks(self, work: list[Row]) -> tuple[list[int], Future[torch.Tensor]] | None:
        """(guided request ids, the future of their masks [G, W]) for the rows that sample after this forward."""
        guided = [(r.id, r.chooser.matcher) for r, s, n in work
                  if s is r and r.chooser is not None and r.chooser.matcher is not None
                  and s.num_cached + n == len(s.tokens) and not r.draft]
        if not guided:
            return None
        return [i for i, _ in guided], self._masks.start([m for _, m in guided])

    @staticmethod
    def _masks_of(started: tuple[list[int], Future[torch.Tensor]] | None) -> dict[int, torch.Tensor]:
        """request id -> its mask [W] int32, from `_start_masks`."""
        if started is None:
            return {}
        ids, future = started
        return dict(zip(ids, future.result()))

    def _finish_embeddings(self, work: list[Row], ready: list[int]) -> list[int]:
        """End the embedding requests whose prompt is all computed ("embedded", `pooled` = the embedding);
        the ready rows left to sample from."""
        for i in ready:
            req = work[i][0]
            if req.pooling is not None and req.pooled is not None:
                req.pooled = pooled_embedding(req.pooled, req.pooling, len(req.prompt), normalize=False)
                self._finish(req, "embedded")
        return [i for i in ready if work[i][0].pooling is None]

    def _accept(self, req: Request, tokens: list[int], produced: list[tuple[Request, int]]) -> None:
        """Append the tokens a verification emitted (up to a stop); keep the K/V of every token but
        the newest (its K/V come with the next step) and free the blocks past them (rollback)."""
        matcher = req.chooser.matcher if req.chooser is not None else None
        for token in tokens:
            if matcher is not None:
                matcher.take(token)
            req.output.append(token)
            produced.append((req, token))
            self._check_stop(req, token)
            if req.finished:
                return
        req.num_cached = len(req.tokens) - 1
        freed = truncate_table(self.allocator, req.blocks, req.num_cached, self.build.tokens_per_block)
        req.reserved += freed
        self.allocator.reserved += freed
        if self.reuse:
            self._cache_full_blocks(req)

    def _choose(self, work: list[Row], ready: list[int], logits: torch.Tensor,
                masks: dict[int, torch.Tensor] | None = None) -> list[tuple[Request, int]]:
        """Next tokens of the ready rows of logits [B, V]: plain requests in one batched call,
        requests with processors one by one (guided ones with their mask [W] from `masks`, by request id,
        or filled now), beam search requests one beam group each."""
        plain = [i for i in ready if work[i][0].search is None
                 and (work[i][0].chooser is None or work[i][0].sampling.guided_only)]
        out: list[tuple[Request, int]] = []
        if plain:
            reqs = [work[i][0] for i in plain]
            rows = logits if plain == list(range(logits.shape[0])) else logits[plain]  # (no copy: every row)
            tokens = sample(self._grammar_masked(rows, reqs, masks or {}), [r.sampling for r in reqs],
                            [r.generator for r in reqs])
            out += zip(reqs, tokens)
        for req, token in out:  # guided plain rows: their grammar takes the token
            if req.chooser is not None and req.chooser.matcher is not None:
                req.chooser.matcher.take(token)
        for i in set(ready) - set(plain):
            req = work[i][0]
            if req.chooser is not None:
                out.append((req, req.chooser.choose(logits[i], (masks or {}).get(req.id))))
        for req, token in out:
            req.output.append(token)
            self._check_stop(req, token)
        groups: dict[int, list[int]] = {}
        for i in ready:
            if work[i][0].search is not None:
                groups.setdefault(work[i][0].id, []).append(i)
        for beam_rows in groups.values():
            out += self._beam_step(work[beam_rows[0]][0], logits[beam_rows])
        return out

    @staticmethod
    def _grammar_masked(rows: torch.Tensor, reqs: list[Request], masks: dict[int, torch.Tensor]) -> torch.Tensor:
        """rows [B, V] with each guided request's row masked by its grammar (masks by request id, or filled now);
        rows itself when none is guided."""
        choosers = {j: r.chooser for j, r in enumerate(reqs) if r.chooser is not None and r.chooser.matcher is not None}
        if not choosers:
            return rows
        guided = list(choosers)
        stacked = torch.stack([masks[reqs[j].id] if reqs[j].id in masks else choosers[j].grammar_mask()[0]
                               for j in guided])  # [G, W]
        rows = rows.float().clone()
        rows[guided] = apply_bitmask(rows[guided], stacked)
        return rows

    def _beam_step(self, req: Request, logits: torch.Tensor) -> list[tuple[Request, int]]:
        """One beam search step on the logits [R, V] of req's running beams (or its prompt)."""
        search = req.search
        assert search is not None, "_choose groups the rows of beam search requests only"
        first = not search.beams
        old = [Beam(req.prompt, blocks=req.blocks, num_cached=req.num_cached)] if first else search.beams
        parents = search.step(logits, old[0] if first else None)
        if first:
            req.blocks = []  # the prompt's table now belongs to `old[0]`, then to the beams
        if search.done:
            for seq in old:
                self.allocator.free(seq.blocks)
                seq.blocks = []
            search.beams = []
            best = search.results()[0]
            req.output = list(best.output_ids)
            self._finish(req, best.finish_reason)
            return [(req, t) for t in req.output]
        allocated, released = fork_block_tables(self.allocator, self.kv, old, parents, search.beams,
                                                self.build.tokens_per_block)
        req.reserved += released - allocated
        self.allocator.reserved += released - allocated
        return []

    def _positions(self, work: list[Row]) -> torch.Tensor | None:
        """Architecture position ids for the packed tokens (None: the default ctx + arange)."""
        if type(self.model).position_ids is DecoderLM.position_ids:
            return None
        parts = [self.model.position_ids(s.tokens, s.num_cached, n) for _, s, n in work]
        return torch.cat(parts, dim=-1)

    def _check_stop(self, req: Request, token: int) -> None:
        s = req.sampling
        if token in req.stop_ids or (req.stop_words and len(req.output) >= s.min_length
                                     and ends_with_any(req.output, req.stop_words)):
            self._finish(req, "stop")
        elif req.chooser is not None and req.chooser.matcher is not None and req.chooser.matcher.stopped:
            self._finish(req, "stop")  # the grammar is complete: only an end id could follow
        elif len(req.output) >= s.max_new_tokens or len(req.tokens) >= self.build.max_seq_len:
            self._finish(req, "length")

    def run(self, requests: list[Request]) -> list[Request]:
        """Step until every request in `requests` has finished."""
        while any(not r.finished for r in requests):
            if not self.running and not self.waiting:
                break
            self.step()
        return requests
