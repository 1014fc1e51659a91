"""The Python API: `LLM(path).generate(prompts, sampling)`, `generate_stream` and the
asyncio `generate_async`.

`path` is an engine dir, a checkpoint dir, or any convertible source (HF dir, .gguf,
...), which is converted and built into a cache dir on first use.

The asyncio API runs every executor call (add, step, cancel) on one worker thread, so the
event loop stays free while the model runs; while any request runs, the worker steps the
executor continuously (adds and cancels queue between steps) and hands each request its
tokens through its own asyncio.Queue on its event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import torch

from bestiary.core.format.cache import cache_dir, file_stamps, record_entry, remove_entry, source_key
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.output_dir import config_kind
from bestiary.core.lora.adapter import LoraAdapter
from bestiary.core.lora.bundle import bundled_adapters, engine_lora
from bestiary.core.lora.cache import LoraCache, LoraCacheConfig
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.engine import load_engine
from bestiary.core.runtime.executor import Executor, Request
from bestiary.core.runtime.guided import GrammarBackends
from bestiary.core.runtime.kv_cache import KvCacheConfig
from bestiary.core.runtime.plugin_processors import ProcessorContext, ProcessorResolver
from bestiary.core.runtime.pooling import Pooling, check_pooling
from bestiary.core.runtime.prompt_log_probs import prompt_log_probs
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.speculative import AcceptanceStats, SpeculativeConfig, speculative_config
from bestiary.core.runtime.step_broadcast import release
from bestiary.core.runtime.text_deltas import TextDeltas
from bestiary.core.runtime.threads import ThreadGovernor, bestiary_chooses, set_threads
from bestiary.core.runtime.worker_group import check_device


def ensure_engine(path: str | Path, dtype: str = "auto", show_progress: bool = False,
                  on_convert: Callable[[Path], None] | None = None) -> Path:
    """An engine/checkpoint dir for `path`, converting and building a source into the cache.

    A directory whose config.json is bestiary's is used as it is (Engine.load names what it
    lacks). Any other source is cached under a key of the content of every file it is read from
    (core.format.cache), so a changed weights, config or tokenizer file converts again, whatever its
    times say; an entry whose files were written while it was converted is discarded. `on_convert`
    is called with the engine dir about to be written when the cache has no engine for `path` yet."""
    path = Path(path)
    if path.is_dir() and config_kind(path / "config.json") is not None:
        return path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.sources import source_files

    files = source_files(path)
    stamps = file_stamps(files)
    key = source_key(path, files, dtype)
    engine_dir = cache_dir() / "engines" / key
    if not (engine_dir / "config.json").is_file():
        ckpt = cache_dir() / "checkpoints" / key
        if on_convert is not None:
            on_convert(engine_dir)
        convert(path, ckpt, ConvertOptions(dtype=dtype), show_progress=show_progress)
        build_engine(ckpt, engine_dir, BuildConfig())
        if file_stamps(source_files(path)) != stamps:
            remove_entry(key)
            raise BestiaryError(f"{path}: its files changed while it was converted; run again")
    record_entry(key, path, dtype)
    return engine_dir


def prompt_list(prompts: str | Sequence[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    """`generate`'s prompts as a list: one text, or one list of token ids, is one prompt (as vLLM's
    LLM.generate takes it; the result is then a list of one Completion). A list of several prompts
    with a bare id among them is a one-line error."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    ids = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
    if items and len(ids) == len(items):
        return [ids]
    several = [t for t in items if not isinstance(t, int)]
    if len(several) < len(items):
        bad = next(t for t in items if isinstance(t, int))
        raise BestiaryError(f"prompt {bad!r}: expected text or a list of token ids")
    return several


def per_prompt(value, count: int, make, name: str, what: str, hint: str) -> list:
    """`make(value)` for each of `count` prompts (made once), or `make` of each item of a list of
    exactly `count` (one per prompt); a list of another length is a one-line error naming `name`."""
    if not isinstance(value, list):
        return [make(value)] * count
    if len(value) != count:
        raise BestiaryError(f"{name}: {len(value)} {what} for {count} prompts; {hint}")
    return [make(v) for v in value]


@dataclass
class GenerationStats:
    """Timing of one generate call."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens after the first / time after the first token."""
        if self.first_token_seconds is None or self.seconds <= self.first_token_seconds:
            return 0.0
        return max(self.generated_tokens - 1, 0) / (self.seconds - self.first_token_seconds)


@dataclass
class BeamCompletion:
    """One finished beam of a beam search request (score = cum_log_prob / len ** length_penalty)."""

    output_ids: list[int]
    text: str | None
    score: float
    cum_log_prob: float
    log_probs: list[float]
    finish_reason: str
    generation_logits: torch.Tensor | None = None  # [len(output_ids), V] when asked


@dataclass
class Completion:
    """One finished request: ids, text and why it stopped (the best beam's, for beam search).

    log_probs / cum_log_prob: with output_log_probs (always for beam search);
    context_logits [len(prompt), V] and generation_logits [len(output), V]: when asked;
    beams: every finished beam, best first (beam search only).
    A finish_reason of "stop" with text cut short means a stop string was found.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    log_probs: list[float] | None = None
    cum_log_prob: float | None = None
    context_logits: torch.Tensor | None = None
    generation_logits: torch.Tensor | None = None
    beams: list[BeamCompletion] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] | None = None  # per token: (id, log p) x top_log_probs
    samples: list[Completion] = field(default_factory=list)  # n > 1: all n samples (this one's fields: sample 0)
    speculative: AcceptanceStats | None = None  # drafted / accepted tokens (LLM(speculative=...) only)


@dataclass
class Delta:
    """What one request of `generate_async` produced in one executor step.

    token_ids: the new ids (the stop token included when it stopped on one).
    text: the new text (stop tokens left out, '' while a UTF-8 character is incomplete),
    or None for an engine without a tokenizer.
    finish_reason: None until the sample's last delta: "stop", "length" or "cancelled".
    index: which of the request's n samples the delta belongs to.
    log_probs / top_log_probs: of the new tokens, with output_log_probs / top_log_probs.
    speculative: the sample's drafted / accepted tokens, on its last delta (LLM(speculative=...) only).
    prompt_log_probs / prompt_top_log_probs: with output_context_logits, on each sample's first delta: the
    prompt tokens' log probs (None for the first) and top_log_probs alternatives (core.runtime.prompt_log_probs).
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None
    index: int = 0
    log_probs: list[float] | None = None
    top_log_probs: list[list[tuple[int, float]]] | None = None
    speculative: AcceptanceStats | None = None
    prompt_log_probs: list[float | None] | None = None
    prompt_top_log_probs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class _Stream:
    """A request of the asyncio API and where its tokens go."""

    request: Request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


EMBEDDING = SamplingConfig(max_new_tokens=1, ignore_eos=True)  # an embedding request's (it generates nothing)


class LLM:
    """A loaded engine with an executor: generate for a batch of prompts, or stream one."""

    def __init__(
        self, path: str | Path, dtype: str = "auto", num_threads: int | None = None, registry=None,
        kv_cache_config: KvCacheConfig | None = None, allow_nonfinite: bool = False, device: str = "cpu",
        speculative: SpeculativeConfig | dict | None = None, lora_cache_config: LoraCacheConfig | dict | None = None,
    ) -> None:
        """device: "cpu", "cuda" or "cuda:N" (a tp > 1 engine's rank r on cuda:N + r). An engine with
        tp_size > 1 starts its ranks (core.runtime.worker_group); under torchrun a rank other than 0
        serves rank 0's steps inside this constructor and then exits."""
        check_device(device)
        governed = bestiary_chooses(num_threads)
        threads = set_threads(num_threads)  # the usable CPUs when not given (core.runtime.threads)
        governor = ThreadGovernor.for_this_process(threads) if governed else None
        if governor is not None:
            governor.settle()  # a loaded machine: fewer threads from the load on
        self.engine = load_engine(ensure_engine(path, dtype), device=device, registry=registry,
                                  allow_nonfinite=allow_nonfinite, num_threads=num_threads)
        self.tokenizer = self.engine.tokenizer
        self.executor = Executor(self.engine.model, self.engine.build, device=str(next(self.engine.model.parameters()).device),
                                 kv_cache_config=kv_cache_config, speculative=speculative_config(speculative))
        # the two-level LoRA cache (adapters by task id); the executor's requests hold their ids
        self.lora_store = LoraCache(self.engine.model, registry, LoraCacheConfig.model_validate(lora_cache_config or {}),
                                    bundled_adapters(self.engine.directory), engine_lora(self.engine.directory))
        self.executor.lora_cache = self.lora_store
        if self.engine.group is None:  # one rank: threads follow the CPUs other processes leave
            self.executor.governor = governor
        if self.tokenizer is not None:  # structured output: grammars over this tokenizer (core.runtime.guided)
            self.executor.grammars = GrammarBackends(self.tokenizer.to_json, self.engine.model.config.vocab_size,
                                                     self.tokenizer.stop_ids, registry)
        self.executor.processors = ProcessorResolver(  # plugins' logits processors (core.runtime.plugin_processors)
            registry, ProcessorContext(self.engine.model.config.vocab_size, self.tokenizer))
        self.last_stats = GenerationStats()
        self._worker: ThreadPoolExecutor | None = None  # the one thread that calls the executor (async API)
        self._streams: dict[int, _Stream] = {}  # request id -> stream; changed on the worker thread only
        self._stepping = False  # the worker's chain of steps runs (changed on the worker, and by _ensure_stepper)

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, list | tuple):
            return list(prompt)
        if not isinstance(prompt, str):
            raise BestiaryError(f"prompt {prompt!r}: expected text or a list of token ids")
        if self.tokenizer is None:
            raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; pass token ids")
        if chat:
            return self.chat_ids([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the chat template (no special tokens added again);
        `tools`: the template's `tools` variable (OpenAI's [{"type": "function", "function": {...}}, ...])."""
        if self.tokenizer is None:
            raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; chat needs one")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _resolve(self, sampling: SamplingConfig | None) -> SamplingConfig:
        """The request's config with text stop/bad words encoded by the tokenizer (no special tokens)."""
        sampling = sampling or SamplingConfig()
        if sampling.stop_strings and self.tokenizer is None:
            raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; stop_strings need one")
        if any(isinstance(w, str) for w in sampling.stop_words + sampling.bad_words):
            if self.tokenizer is None:
                raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; give stop/bad words as ids")
            sampling = sampling.with_text_encoded(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        return sampling

    def _per_prompt(self, sampling: SamplingConfig | list[SamplingConfig] | None, count: int) -> list[SamplingConfig]:
        """One resolved config per prompt: `sampling` repeated, or its list (one per prompt)."""
        return per_prompt(sampling, count, self._resolve, "sampling", "SamplingConfigs",
                          "give one config, or a list with one per prompt")

    def _adapters(self, lora: LoraRequest | list[LoraRequest | None] | None, count: int) -> list[LoraAdapter | None]:
        """One adapter per prompt (None: the base model): `lora` repeated, or its list (one per prompt)."""
        taken: list[LoraAdapter | None] = []

        def take(request: LoraRequest | None) -> LoraAdapter | None:
            taken.append(self.lora_store.take(request))
            return taken[-1]

        try:  # one hold per prompt: a single LoraRequest is taken for each
            return per_prompt(lora if isinstance(lora, list) else [lora] * count, count, take, "lora", "LoraRequests",
                              "give one, or a list with one per prompt (None: the base model)")
        except BaseException:
            self._release(taken)
            raise

    def _release(self, adapters: list[LoraAdapter | None]) -> None:
        """Give back the holds of adapters whose requests never reached the executor."""
        for adapter in adapters:
            if adapter is not None:
                self.lora_store.release(adapter)

    def _stop_ids(self) -> set[int]:
        return self.tokenizer.stop_ids if self.tokenizer else set()

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([i for i in ids if i not in self._stop_ids()])

    def _check_sync_allowed(self) -> None:
        """The sync API drives the executor itself: only when no async request is running.

        An async stream that was just closed has its cancel queued on the worker thread; wait
        for the worker's queue first, so it no longer counts.
        """
        if self._worker is not None:
            self._worker.submit(lambda: None).result()
        if self._streams:
            raise BestiaryError(f"{len(self._streams)} generate_async requests are running: "
                                "wait for them before calling generate / generate_stream")

    def generate(
        self, prompts: str | Sequence[int] | Sequence[str | list[int]],
        sampling: SamplingConfig | list[SamplingConfig] | None = None, chat: bool = False, *, lora: LoraRequest | list[LoraRequest | None] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt in one in-flight batch; completions in prompt order.

        prompts: a list of texts and/or token id lists; a single text (or id list) is one prompt
        and gives a list of one Completion (vLLM's convention).

        sampling: one config for every prompt, or a list with one per prompt.
        lora: one LoraRequest for every prompt, or a list with one per prompt (None: the base model).
        """
        self._check_sync_allowed()
        prompts = prompt_list(prompts)
        configs = self._per_prompt(sampling, len(prompts))
        adapters = self._adapters(lora, len(prompts))
        start = time.perf_counter()
        requests: list[Request] = []
        try:
            for p, s, a in zip(prompts, configs, adapters):
                requests.append(self.executor.add(self._prompt_ids(p, chat), s, self._stop_ids(), lora=a))
        except BaseException:  # nothing of this call stays queued
            self._release(adapters[len(requests):])
            for req in requests:
                self.executor.cancel(req)
            raise
        samples = [s for r in requests for s in r.group]
        tokenizer = self.tokenizer  # _resolve refused stop strings without one
        texts = {s.id: TextDeltas(tokenizer, s.stop_ids, s.sampling.stop_strings)
                 for s in samples if s.sampling.stop_strings and tokenizer is not None}
        stats = GenerationStats(prompt_tokens=sum(len(r.prompt) for r in requests))
        try:
            while any(not s.finished for s in samples):
                produced = self.executor.step()
                if produced and stats.first_token_seconds is None:
                    stats.first_token_seconds = time.perf_counter() - start
                self._match_stop_strings(produced, texts)
        except BaseException:  # a step failed (or Ctrl-C): nothing of this call stays in the batch
            for req in requests:
                self.executor.cancel(req)
            raise
        stats.seconds = time.perf_counter() - start
        stats.generated_tokens = sum(len(s.output) for s in samples)
        self.last_stats = stats
        return [self._completion(r, stats, texts) for r in requests]

    def embed(self, inputs: str | Sequence[int] | Sequence[str | list[int]], pooling: Pooling | None = None,
              normalize: bool = True) -> torch.Tensor:
        """Embeddings [N, H] float32 of N inputs (texts and/or token id lists; one text or id list: N = 1):
        the final-norm hidden states pooled (core.runtime.pooling; `pooling` default: the model's
        `default_pooling`) and L2-normalised unless `normalize` is False; the prompts run in one batch."""
        self._check_sync_allowed()
        how = check_pooling(pooling or self.engine.model.default_pooling)
        requests: list[Request] = []
        try:
            for p in prompt_list(inputs):
                requests.append(self.executor.add(self._prompt_ids(p, False), EMBEDDING, set(), pooling=how))
            while any(not r.finished for r in requests):
                self.executor.step()
        except BaseException:  # nothing of this call stays queued
            for req in requests:
                self.executor.cancel(req)
            raise
        return torch.stack([self._embedding_of(r, normalize) for r in requests])

    @staticmethod
    def _embedding_of(req: Request, normalize: bool) -> torch.Tensor:
        """A finished embedding request's vector [H] float32, L2-normalised when asked."""
        if req.finish_reason != "embedded" or req.pooled is None:
            raise BestiaryError(f"embedding request ended {req.finish_reason!r}")
        return torch.nn.functional.normalize(req.pooled, dim=0) if normalize else req.pooled

    async def embed_async(self, prompt: str | list[int], pooling: Pooling | None = None) -> torch.Tensor:
        """The normalised embedding [H] float32 of one input, computed in the shared in-flight batch (the
        async API's worker thread, as generate_async); cancelling the awaiting task drops the request."""
        how = check_pooling(pooling or self.engine.model.default_pooling)
        ids = self._prompt_ids(prompt, False)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bestiary-executor")
        req = await self._added(loop.run_in_executor(self._worker, self._add_stream, ids, EMBEDDING, queue, loop,
                                                     None, how))
        try:
            self._ensure_stepper(loop)
            while not req.finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
            return self._embedding_of(req, True)
        finally:
            if not req.finished or req.id in self._streams:
                self._running_worker().submit(self._drop_stream, req)

    def _match_stop_strings(self, produced: list[tuple[Request, int]], texts: dict[int, TextDeltas]) -> None:
        """Feed the new tokens of the requests with stop strings; stop those whose text hit one."""
        if not texts:
            return
        news: dict[int, tuple[Request, list[int]]] = {}
        for req, token in produced:
            if req.id in texts:
                news.setdefault(req.id, (req, []))[1].append(token)
        for rid, (req, tokens) in news.items():
            texts[rid].push(tokens, final=req.finished)
            if texts[rid].stopped and not req.finished:
                self.executor.stop(req)

    def _completion(self, req: Request, stats: GenerationStats, texts: dict[int, TextDeltas] | None = None) -> Completion:
        texts = texts or {}
        done = Completion(req.prompt, req.output, self._decode(req.output), req.finish_reason, stats)
        if self.executor.speculator is not None:
            done.speculative = req.spec
        if req.id in texts:
            text = texts[req.id]
            text.push([], final=not text.stopped)  # flush what was held back for a possible stop string
            done.text = text.output
            done.finish_reason = "stop" if text.stopped else req.finish_reason
        if req.siblings:
            done.samples = [done] + [self._completion(s, stats, texts) for s in req.siblings]
        if req.context_logits:
            done.context_logits = torch.cat(req.context_logits)
        if req.chooser is not None:
            if req.sampling.output_log_probs or req.sampling.top_log_probs:
                done.log_probs = list(req.chooser.log_probs)
                done.cum_log_prob = float(sum(done.log_probs))
            if req.sampling.top_log_probs:
                done.top_log_probs = list(req.chooser.top_log_probs)
            if req.chooser.logits:
                done.generation_logits = torch.stack(req.chooser.logits)
        if req.search is not None:
            for h in req.search.results():
                logits = torch.stack(h.logits) if h.logits else None
                done.beams.append(BeamCompletion(h.output_ids, self._decode(h.output_ids), h.score, h.cum_log_prob,
                                                 h.log_probs, h.finish_reason, logits))
            if done.beams:
                best = done.beams[0]
                done.log_probs, done.cum_log_prob, done.generation_logits = best.log_probs, best.cum_log_prob, best.generation_logits
        return done

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling: SamplingConfig | list[SamplingConfig] | None = None,
        *, add_generation_prompt: bool = True, lora: LoraRequest | list[LoraRequest | None] | None = None,
    ) -> list[Completion]:
        """Reply to one conversation ([{"role": ..., "content": ...}, ...]) or to each of a list of them.

        Each conversation is rendered with the chat template (as transformers' apply_chat_template
        does) and generated in one batch; one Completion per conversation (a list of one for one).
        """
        one = bool(messages) and isinstance(messages[0], dict)  # one conversation: its first item a message
        conversations = cast("list[list[dict]]", [messages] if one else messages)
        prompts = [self.chat_ids(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling, lora=lora)

    def generate_stream(
        self, prompt: str | list[int], sampling: SamplingConfig | None = None, chat: bool = False, *,
        lora: LoraRequest | None = None,
    ) -> Iterator[str | int]:
        """Yield text deltas (or ids, without a tokenizer) as tokens are generated (one sample: n = 1)."""
        self._check_sync_allowed()
        sampling = self._resolve(sampling)
        if sampling.n > 1:
            raise BestiaryError(f"generate_stream streams one sample; n = {sampling.n}: use generate or generate_async")
        start = time.perf_counter()
        adapter = self.lora_store.take(lora)
        try:
            req = self.executor.add(self._prompt_ids(prompt, chat), sampling, self._stop_ids(), lora=adapter)
        except BaseException:
            self._release([adapter])
            raise
        stats = GenerationStats(prompt_tokens=len(req.prompt))
        text = TextDeltas(self.tokenizer, req.stop_ids, sampling.stop_strings) if self.tokenizer else None
        try:
            while not req.finished:
                tokens = [t for r, t in self.executor.step() if r is req]
                if tokens and stats.first_token_seconds is None:
                    stats.first_token_seconds = time.perf_counter() - start
                if text is None:
                    yield from tokens
                    continue
                delta = text.push(tokens, final=req.finished) if tokens or req.finished else ""
                if text.stopped and not req.finished:
                    self.executor.stop(req)
                if delta:
                    yield delta
        finally:
            if not req.finished:
                self.executor.cancel(req)
            stats.seconds = time.perf_counter() - start
            stats.generated_tokens = len(req.output)
            self.last_stats = stats

    # --- asyncio -------------------------------------------------------------------------
    async def generate_async(
        self, prompt: str | list[int], sampling: SamplingConfig | None = None, chat: bool = False, *,
        lora: LoraRequest | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Yield a `Delta` per step that gives this request tokens; the last one has a finish_reason.

        Any number of calls may run at once on one event loop: they share one in-flight batch.
        Cancelling the consuming task (or closing the iterator) cancels the request and frees
        its KV blocks. Limit errors (prompt too long, ...) are raised before the first delta.
        """
        sampling = self._resolve(sampling)
        ids = self._prompt_ids(prompt, chat)
        adapter = self.lora_store.take(lora)  # an unknown task id fails this request alone
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bestiary-executor")
        req = await self._added(loop.run_in_executor(self._worker, self._add_stream, ids, sampling, queue, loop,
                                                     adapter))
        try:  # from here on, however this generator ends, the request is dropped (its KV blocks freed)
            self._ensure_stepper(loop)
            texts = [TextDeltas(self.tokenizer, s.stop_ids, sampling.stop_strings) if self.tokenizer else None
                     for s in req.group]
            running = set(range(len(req.group)))
            echoed: set[int] = set()  # samples whose first delta carried the prompt's log probs
            while running:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, tokens, reason, log_probs, top = item
                if index not in running:  # a sample stopped by its stop string still had tokens on the way
                    continue
                text = texts[index]
                piece = text.push(tokens, final=reason is not None) if text else None
                if text is not None and text.stopped and reason is None:
                    reason = "stop"
                    self._running_worker().submit(self._stop_sample, req.group[index])
                if reason is not None:
                    running.discard(index)
                spec = None  # a copy of the sample's acceptance counts, on its last delta
                if reason is not None and self.executor.speculator is not None:
                    spec = replace(req.group[index].spec)
                delta = Delta(tokens, piece, reason, index, log_probs, top, spec)
                if index not in echoed and sampling.output_context_logits and req.context_logits:
                    echoed.add(index)
                    delta.prompt_log_probs, delta.prompt_top_log_probs = prompt_log_probs(
                        req.prompt, torch.cat(req.context_logits), sampling.top_log_probs)
                yield delta
        finally:
            if any(not s.finished or s.id in self._streams for s in req.group):
                self._running_worker().submit(self._drop_stream, req)

    async def _added(self, adding: asyncio.Future[Request]) -> Request:
        """The request the worker thread is adding. Cancelled meanwhile (a client gone), the thread still adds
        it: it is dropped as soon as it is in, so its KV blocks never stay held by a request nobody reads."""
        try:
            return await asyncio.shield(adding)
        except asyncio.CancelledError:
            def drop(done: asyncio.Future[Request]) -> None:
                if not done.cancelled() and done.exception() is None and self._worker is not None:
                    self._worker.submit(self._drop_stream, done.result())

            adding.add_done_callback(drop)
            raise

    def _running_worker(self) -> ThreadPoolExecutor:
        """The async API's worker thread (generate_async starts it; close() ends it)."""
        if self._worker is None:
            raise BestiaryError("LLM.close() was called while generate_async requests ran")
        return self._worker

    def _add_stream(self, ids: list[int], sampling: SamplingConfig, queue: asyncio.Queue,
                    loop: asyncio.AbstractEventLoop, adapter: LoraAdapter | None = None,
                    pooling: Pooling | None = None) -> Request:
        """(worker thread) Queue a request and start delivering the tokens of each of its samples."""
        try:
            req = self.executor.add(ids, sampling, set() if pooling else self._stop_ids(), lora=adapter,
                                    pooling=pooling)
        except BaseException:
            self._release([adapter])
            raise
        for sample in req.group:
            self._streams[sample.id] = _Stream(sample, queue, loop)
        return req

    def _stop_sample(self, sample: Request) -> None:
        """(worker thread) End a sample whose text reached a stop string."""
        self._streams.pop(sample.id, None)
        if not sample.finished:
            self.executor.stop(sample)

    def _drop_stream(self, req: Request) -> None:
        """(worker thread) Cancel a request (all its samples) whose consumer went away."""
        for sample in req.group:
            self._streams.pop(sample.id, None)
        if any(not s.finished for s in req.group):
            self.executor.cancel(req)

    def _ensure_stepper(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the worker's chain of steps unless it runs (called after a stream was added)."""
        if not self._stepping:
            self._stepping = True
            self._running_worker().submit(self._step_and_deliver)

    def _step_and_deliver(self) -> None:
        """(worker thread) One executor step; each sample with news puts
        (index, tokens, finish_reason, log probs, top log probs) on its stream's queue.

        While any stream is unfinished the step queues the next one behind whatever was
        submitted meanwhile (adds, cancels), so the worker steps without waiting for an event
        loop, and the loops write their responses while the model runs.
        """
        try:
            self._deliver_one_step()
        finally:
            self._stepping = bool(self._streams)
            if self._stepping:
                try:
                    self._running_worker().submit(self._step_and_deliver)
                except RuntimeError:  # close() shut the worker down
                    self._stepping = False

    def _deliver_one_step(self) -> None:
        """(worker thread) The body of `_step_and_deliver`."""
        try:
            produced = self.executor.step() if self.executor.has_work else []
        except Exception as err:  # every waiting consumer sees the failure; its request is dropped
            for stream in self._streams.values():
                self.executor.cancel(stream.request)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            self._streams.clear()
            return
        if not produced and not self.executor.has_work:
            time.sleep(0.001)  # only finished streams left to report: no busy loop
        news: dict[int, list[int]] = {}
        for req, token in produced:
            if req.id in self._streams:
                news.setdefault(req.id, []).append(token)
        for rid, stream in list(self._streams.items()):
            req = stream.request
            if rid in news or req.finished:
                tokens = news.get(rid, [])
                item = (req.index, tokens, req.finish_reason, *_new_log_probs(req, len(tokens)))
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            if req.finished:
                del self._streams[rid]

    def close(self) -> None:
        """Stop the asyncio API's worker thread (after the requests it runs)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        release(self.engine)  # a multi-rank engine's ranks drop it (the worker group stays for the next)


def _new_log_probs(req: Request, count: int) -> tuple[list[float] | None, list | None]:
    """Log probs and top log probs of req's last `count` tokens (None when not asked for)."""
    chooser = req.chooser
    if chooser is None or not chooser.log_probs:
        return None, None
    cut = len(chooser.log_probs) - count
    return chooser.log_probs[cut:], chooser.top_log_probs[cut:] if req.sampling.top_log_probs else None
