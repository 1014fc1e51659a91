"""A system under test: the calls every workload makes, and bestiary's own engine as one.

`generate(prompt, n)` times one greedy generation of n new tokens (EOS ignored where the
system allows it; the tokens really produced are counted) from a cold cache: no prefix of an
earlier call reused. The prefill workload is `generate(prompt, 1)`. `mixed(work)` runs a workload's
requests, all submitted at once, however the system batches them; None when it cannot. The
rewrite workload needs two more calls that only engines have: `rewrite_prompts(count, tokens)`
(text prompts in the system's own chat template) and `complete(prompt, n)` (stops at EOS, returns
the ids too).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from bestiary.core.bench.workload import MixedResult, Timed, Workload


class System(Protocol):
    """What `bestiary bench` asks of an engine or a peer."""

    max_prompt_len: int | None  # longest prompt it takes (None: no limit known)
    bytes_per_token: int | None  # weight bytes read per decoded token at batch 1 (None: unknown)
    mixed_note: str  # why `mixed` returns None, when it does

    def generate(self, prompt: list[int], n: int) -> Timed: ...

    def mixed(self, work: Workload) -> MixedResult | None: ...

    def close(self) -> None: ...


@runtime_checkable
class RewriteSystem(Protocol):
    """The two more calls of the rewrite workload, which only engines have (EngineSystem)."""

    def rewrite_prompts(self, count: int, tokens: int) -> list[list[int]]: ...

    def complete(self, prompt: list[int], n: int) -> tuple[Timed, list[int]]: ...


def engine_bytes_per_token(engine_dir: Path, shares_embedding: bool) -> int:
    """Weight bytes read per decoded token: every stored tensor once, except an embedding table that
    is not also the lm_head (one row of it is read)."""
    from safetensors import safe_open

    total = 0
    for rank_file in sorted(engine_dir.glob("rank*.safetensors")):
        with safe_open(str(rank_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle
                if key.endswith("vocab_embedding.weight") and not shares_embedding:
                    continue
                part = f.get_slice(key)
                numel = 1
                for d in part.get_shape():
                    numel *= d
                total += numel * DTYPE_BYTES.get(part.get_dtype(), 4)
    return total


DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8,
               "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


class EngineSystem:
    """A bestiary engine through the LLM API, prefix reuse off (each timed call computes its prompt)."""

    mixed_note = ""

    def __init__(self, engine_dir: str | Path, num_threads: int | None = None, speculative=None) -> None:
        """speculative: a SpeculativeConfig (core.runtime.speculative_config), or None: plain decoding."""
        from bestiary.core.runtime.kv_cache import KvCacheConfig
        from bestiary.core.runtime.llm import LLM

        self.llm = LLM(engine_dir, num_threads=num_threads, kv_cache_config=KvCacheConfig(enable_block_reuse=False),
                       speculative=speculative)
        self._spec_seen = (0, 0, 0)  # the speculator's (steps, drafted, accepted) at the last speculative_since
        engine = self.llm.engine
        self.max_prompt_len = engine.build.max_input_len
        self.bytes_per_token: int | None = engine_bytes_per_token(engine.directory, engine.model.shares_embedding)
        self.vocab_size = engine.model.config.vocab_size

    def _sampling(self, n: int):
        from bestiary.core.runtime.sampling import SamplingConfig

        return SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    def generate(self, prompt: list[int], n: int) -> Timed:
        start = time.perf_counter()
        (done,) = self.llm.generate([prompt], self._sampling(n))
        return Timed(time.perf_counter() - start, len(done.output_ids))

    def rewrite_prompts(self, count: int, tokens: int) -> list[list[int]]:
        """The rewrite workload's prompts (core.bench.rewrite) in this engine's chat template."""
        from bestiary.core.bench.rewrite import rewrite_messages, source_texts
        from bestiary.core.format.errors import BestiaryError

        if self.llm.tokenizer is None:
            raise BestiaryError(f"--workloads rewrite: engine {self.llm.engine.directory} has no tokenizer")
        texts = source_texts(self.llm.tokenizer, count, tokens)
        return [self.llm.chat_ids(rewrite_messages(t)) for t in texts]

    def complete(self, prompt: list[int], n: int) -> tuple[Timed, list[int]]:
        """One greedy generation of at most n new tokens that stops at an end id: its time and ids."""
        from bestiary.core.runtime.sampling import SamplingConfig

        start = time.perf_counter()
        (done,) = self.llm.generate([prompt], SamplingConfig(max_new_tokens=n, temperature=0.0))
        return Timed(time.perf_counter() - start, len(done.output_ids)), list(done.output_ids)

    def mixed(self, work: Workload) -> MixedResult:
        """Every request to the executor at once (in-flight batching); latency = submit -> last token."""
        ex = self.llm.executor
        start = time.perf_counter()
        reqs = [ex.add(p, self._sampling(n)) for p, n in zip(work.prompts, work.max_new, strict=True)]
        done: dict[int, float] = {}
        while ex.has_work:
            ex.step()
            now = time.perf_counter() - start
            for r in reqs:
                if r.finished and r.id not in done:
                    done[r.id] = now
        seconds = time.perf_counter() - start
        return MixedResult(seconds, [done[r.id] for r in reqs], sum(len(r.output) for r in reqs))

    def speculative_since(self):
        """The speculative steps, drafted and accepted tokens since the last call, as an AcceptanceStats
        (core.runtime.speculative); None when this engine decodes plainly."""
        from bestiary.core.runtime.speculative import AcceptanceStats

        speculator = self.llm.executor.speculator
        if speculator is None:
            return None
        s = speculator.stats
        now = (s.steps, s.drafted, s.accepted)
        since = AcceptanceStats(*(a - b for a, b in zip(now, self._spec_seen)))
        self._spec_seen = now
        return since

    def close(self) -> None:
        self.llm.close()
