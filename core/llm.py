"""The Python API: `LLM(path).generate(prompts, sampling)` and `generate_stream`.

`path` is an engine dir, a checkpoint dir, or any convertible source (HF dir, .gguf,
...), which is converted and built into a cache dir on first use.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bestiary.core.engine import Engine
from bestiary.core.errors import BestiaryError
from bestiary.core.executor import Executor, Request
from bestiary.core.sampling import SamplingConfig
from bestiary.core.tokenizer import StreamDecoder


def cache_dir() -> Path:
    """Where on-the-fly conversions go ($BESTIARY_CACHE or ~/.cache/bestiary)."""
    return Path(os.environ.get("BESTIARY_CACHE", Path.home() / ".cache" / "bestiary"))


def ensure_engine(path: str | Path, dtype: str = "auto", show_progress: bool = False) -> Path:
    """An engine/checkpoint dir for `path`, converting and building a source into the cache."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file() and (path / "rank0.safetensors").is_file():
        return path
    from bestiary.core.build import BuildConfig, build_engine
    from bestiary.core.convert import convert

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
class Completion:
    """One finished request: ids, text and why it stopped."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


class LLM:
    """A loaded engine with an executor: generate for a batch of prompts, or stream one."""

    def __init__(
        self, path: str | Path, dtype: str = "auto", num_threads: int | None = None, registry=None
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.engine = Engine.load(ensure_engine(path, dtype), registry=registry)
        self.tokenizer = self.engine.tokenizer
        self.executor = Executor(self.engine.model, self.engine.build)
        self.last_stats = GenerationStats()

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise BestiaryError(f"{self.engine.directory}: engine has no tokenizer; pass token ids")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def _stop_ids(self) -> set[int]:
        return self.tokenizer.stop_ids if self.tokenizer else set()

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([i for i in ids if i not in self._stop_ids()])

    def generate(
        self, prompts: list[str | list[int]], sampling: SamplingConfig | None = None, chat: bool = False
    ) -> list[Completion]:
        """Generate for every prompt in one in-flight batch; completions in prompt order."""
        sampling = sampling or SamplingConfig()
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
        return Completion(req.prompt, req.output, self._decode(req.output), req.finish_reason, stats)

    def generate_stream(
        self, prompt: str | list[int], sampling: SamplingConfig | None = None, chat: bool = False
    ) -> Iterator[str | int]:
        """Yield text deltas (or ids, without a tokenizer) as tokens are generated."""
        sampling = sampling or SamplingConfig()
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
