"""The Python API: `LLM(path).generate(prompts, sampling)`, `generate_stream` and the
asyncio `generate_async`.

`path` is an engine dir, a checkpoint dir, or any convertible source (HF dir, .gguf,
...), which is converted and built into a cache dir on first use.

The asyncio API runs every executor call (add, step, cancel) on one worker thread, so the
event loop stays free while the model runs; one stepping task per event loop serves all
concurrent requests and hands each its tokens through its own asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bestiary.core.format.cache import cache_dir
from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.executor import Executor, Request
from bestiary.core.runtime.kv_cache import KvCacheConfig
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.tokenizer import StreamDecoder


def ensure_engine(path: str | Path, dtype: str = "auto", show_progress: bool = False) -> Path:
    """An engine/checkpoint dir for `path`, converting and building a source into the cache."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file() and (path / "rank0.safetensors").is_file():
        return path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import convert

    stat = path.stat() if path.exists() else None
    key = hashlib.sha1(f"{path.absolute()}|{stat and stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    engine_dir = cache_dir() / "engines" / key
    if not (engine_dir / "config.json").is_file():
        ckpt = cache_dir() / "checkpoints" / key
        convert(path, ckpt, dtype=dtype, show_progress=show_progress)
        build_engine(ckpt, engine_dir, BuildConfig())
    return engine_dir


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


@dataclass
class Delta:
    """What one request of `generate_async` produced in one executor step.

    token_ids: the new ids (the stop token included when it stopped on one).
    text: the new text (stop tokens left out, '' while a UTF-8 character is incomplete),
    or None for an engine without a tokenizer.
    finish_reason: None until the request's last delta: "stop", "length" or "cancelled".
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None


@dataclass
class _Stream:
    """A request of the asyncio API and where its tokens go."""

    request: Request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class LLM:
    """A loaded engine with an executor: generate for a batch of prompts, or stream one."""

    def __init__(
        self, path: str | Path, dtype: str = "auto", num_threads: int | None = None, registry=None,
        kv_cache_config: KvCacheConfig | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.engine = Engine.load(ensure_engine(path, dtype), registry=registry)
        self.tokenizer = self.engine.tokenizer
        self.executor = Executor(self.engine.model, self.engine.build, kv_cache_config=kv_cache_config)
        self.last_stats = GenerationStats()
        self._worker: ThreadPoolExecutor | None = None  # the one thread that calls the executor (async API)
        self._streams: dict[int, _Stream] = {}  # request id -> stream; changed on the worker thread only
        self._stepper: asyncio.Task | None = None

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; pass token ids")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def _resolve(self, sampling: SamplingConfig | None) -> SamplingConfig:
        """The request's config with text stop/bad words encoded by the tokenizer (no special tokens)."""
        sampling = sampling or SamplingConfig()
        if any(isinstance(w, str) for w in sampling.stop_words + sampling.bad_words):
            if self.tokenizer is None:
                raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; give stop/bad words as ids")
            sampling = sampling.with_text_encoded(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        return sampling

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
        self, prompts: list[str | list[int]], sampling: SamplingConfig | None = None, chat: bool = False
    ) -> list[Completion]:
        """Generate for every prompt in one in-flight batch; completions in prompt order."""
        self._check_sync_allowed()
        sampling = self._resolve(sampling)
        start = time.perf_counter()
        requests = [self.executor.add(self._prompt_ids(p, chat), sampling, self._stop_ids()) for p in prompts]
        stats = GenerationStats(prompt_tokens=sum(len(r.prompt) for r in requests))
        while any(not r.finished for r in requests):
            produced = self.executor.step()
            if produced and stats.first_token_seconds is None:
                stats.first_token_seconds = time.perf_counter() - start
        stats.seconds = time.perf_counter() - start
        stats.generated_tokens = sum(len(r.output) for r in requests)
        self.last_stats = stats
        return [self._completion(r, stats) for r in requests]

    def _completion(self, req: Request, stats: GenerationStats) -> Completion:
        done = Completion(req.prompt, req.output, self._decode(req.output), req.finish_reason, stats)
        if req.context_logits:
            done.context_logits = torch.cat(req.context_logits)
        if req.chooser is not None:
            if req.sampling.output_log_probs:
                done.log_probs = list(req.chooser.log_probs)
                done.cum_log_prob = float(sum(done.log_probs))
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

    def generate_stream(
        self, prompt: str | list[int], sampling: SamplingConfig | None = None, chat: bool = False
    ) -> Iterator[str | int]:
        """Yield text deltas (or ids, without a tokenizer) as tokens are generated."""
        self._check_sync_allowed()
        sampling = self._resolve(sampling)
        start = time.perf_counter()
        req = self.executor.add(self._prompt_ids(prompt, chat), sampling, self._stop_ids())
        stats = GenerationStats(prompt_tokens=len(req.prompt))
        decoder = StreamDecoder(self.tokenizer) if self.tokenizer else None
        try:
            while not req.finished:
                for r, token in self.executor.step():
                    if r is not req:
                        continue
                    if stats.first_token_seconds is None:
                        stats.first_token_seconds = time.perf_counter() - start
                    if decoder is None:
                        yield token
                    elif token not in req.stop_ids:
                        delta = decoder.push(token)
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
        self, prompt: str | list[int], sampling: SamplingConfig | None = None, chat: bool = False
    ) -> AsyncIterator[Delta]:
        """Yield a `Delta` per step that gives this request tokens; the last one has a finish_reason.

        Any number of calls may run at once on one event loop: they share one in-flight batch.
        Cancelling the consuming task (or closing the iterator) cancels the request and frees
        its KV blocks. Limit errors (prompt too long, ...) are raised before the first delta.
        """
        sampling = self._resolve(sampling)
        ids = self._prompt_ids(prompt, chat)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bestiary-executor")
        req = await loop.run_in_executor(self._worker, self._add_stream, ids, sampling, queue, loop)
        self._ensure_stepper(loop)
        text = _TextDeltas(self.tokenizer, req.stop_ids) if self.tokenizer else None
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                tokens, reason = item
                yield Delta(tokens, text.push(tokens, final=reason is not None) if text else None, reason)
                if reason is not None:
                    return
        finally:
            if not req.finished or req.id in self._streams:
                self._worker.submit(self._drop_stream, req)

    def _add_stream(self, ids: list[int], sampling: SamplingConfig, queue: asyncio.Queue,
                    loop: asyncio.AbstractEventLoop) -> Request:
        """(worker thread) Queue a request and start delivering its tokens."""
        req = self.executor.add(ids, sampling, self._stop_ids())
        self._streams[req.id] = _Stream(req, queue, loop)
        return req

    def _drop_stream(self, req: Request) -> None:
        """(worker thread) Cancel a request whose consumer went away."""
        self._streams.pop(req.id, None)
        if not req.finished:
            self.executor.cancel(req)

    def _ensure_stepper(self, loop: asyncio.AbstractEventLoop) -> None:
        task = self._stepper
        if task is None or task.done() or task.get_loop() is not loop:
            self._stepper = loop.create_task(self._step_loop(), name="bestiary-step-loop")

    async def _step_loop(self) -> None:
        """Step the executor on the worker thread while any async request is unfinished."""
        loop = asyncio.get_running_loop()
        while self._streams:
            await loop.run_in_executor(self._worker, self._step_and_deliver)
        if self._stepper is asyncio.current_task():
            self._stepper = None

    def _step_and_deliver(self) -> None:
        """(worker thread) One executor step; each stream with news gets (tokens, finish_reason)."""
        try:
            produced = self.executor.step() if self.executor.has_work else []
        except Exception as err:  # every waiting consumer sees the failure; its request is dropped
            for stream in self._streams.values():
                self.executor.cancel(stream.request)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            self._streams.clear()
            return
        news: dict[int, list[int]] = {}
        for req, token in produced:
            if req.id in self._streams:
                news.setdefault(req.id, []).append(token)
        for rid, stream in list(self._streams.items()):
            req = stream.request
            if rid in news or req.finished:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (news.get(rid, []), req.finish_reason))
            if req.finished:
                del self._streams[rid]

    def close(self) -> None:
        """Stop the asyncio API's worker thread (after the requests it runs)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


class _TextDeltas:
    """Text deltas of one request's tokens: stop tokens left out, UTF-8 characters kept whole."""

    def __init__(self, tokenizer, stop_ids: set[int]) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.stop_ids = stop_ids

    def push(self, tokens: list[int], final: bool) -> str:
        """New text of `tokens`; at the end, whatever an incomplete character held back too."""
        out = "".join(self.decoder.push(t) for t in tokens if t not in self.stop_ids)
        if final and self.decoder.ids:
            text = self.decoder.tokenizer.decode(self.decoder.ids)
            if len(text) > len(self.decoder.emitted) and text.startswith(self.decoder.emitted):
                out += text[len(self.decoder.emitted):]
                self.decoder.emitted = text
        return out
