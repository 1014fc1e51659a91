"""Batch invariance checks: does a request's result depend on what else ran with it?

A request's greedy tokens and the logits it sampled them from, run on an `Executor` in four ways:

- alone: a fresh executor, no prefix reuse, the whole prompt in one step;
- batch: the same request among others of mixed lengths, with long prompts arriving while it decodes
  (its decode rows share steps with long prefills);
- reused: the same request again on an executor that has just run it (its prefix blocks reused: only
  the prompt's last partial block is computed, over the cached keys);
- chunked: an executor whose steps hold at most `chunk` tokens (the prompt prefilled in chunks).

`compare` gives, for each way against alone, the number of greedy tokens equal before the first
difference and the largest |logit difference| over the steps up to and including that one:
0.0 everywhere means the results are bit for bit those of the request run alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bestiary.core.format.build_config import BuildConfig, finalize_build_config
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.executor import Executor, Request, Row
from bestiary.core.runtime.kv_cache import KvCacheConfig
from bestiary.core.runtime.sampling import SamplingConfig

WAYS = ("batch", "reused", "chunked")
FAMILIES = ("llama", "mistral", "bloom", "mixtral")  # tiny_source's: each its own attention path
TINY: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def tiny_source(family: str, directory: Path) -> Path:
    """A tiny random transformers model saved to directory / family (head_dim 32: the compiled kernels'
    shapes): llama (causal, the compiled prefill attention on bf16), mistral (a 16-token sliding window),
    bloom (ALiBi), mixtral (MoE)."""
    import transformers

    from bestiary.testing.parity import reinit_

    torch.manual_seed(0)
    model: transformers.PreTrainedModel
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=16))
    elif family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    elif family == "bloom":
        model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=512, hidden_size=128, n_layer=2,
                                                                       n_head=4))
    else:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    reinit_(model).save_pretrained(directory / family)
    return directory / family


@dataclass
class Run:
    """One request's greedy tokens and the logits rows [V] (float32) it sampled each from."""

    tokens: list[int]
    logits: list[torch.Tensor]


@dataclass
class Agreement:
    """A run against the request alone: tokens equal before the first difference (of `total`), and the
    largest |logit difference| over the steps up to the first differing token (included)."""

    equal: int
    total: int
    max_diff: float

    @property
    def same(self) -> bool:
        """Every token equal and every compared logit bit for bit."""
        return self.equal == self.total and self.max_diff == 0.0


def recording(ex: Executor) -> dict[int, list[torch.Tensor]]:
    """Make `ex` record the logits rows it samples from: request id -> rows [V] float32 in order."""
    seen: dict[int, list[torch.Tensor]] = {}
    choose = ex._choose

    def record(work: list[Row], ready: list[int], logits: torch.Tensor,
               masks: dict[int, torch.Tensor] | None = None) -> list[tuple[Request, int]]:
        for i in ready:
            seen.setdefault(work[i][0].id, []).append(logits[i].float().clone())
        return choose(work, ready, logits, masks)

    ex._choose = record  # type: ignore[method-assign]
    return seen


def executor(engine: Engine, max_num_tokens: int = 4096, reuse: bool = False, block: int = 16,
             batch: int = 16) -> Executor:
    """A fresh executor on `engine`'s model: steps of at most `max_num_tokens`, prefix reuse on or off."""
    build = finalize_build_config(BuildConfig(tokens_per_block=block, max_batch_size=batch, max_seq_len=768,
                                              max_num_tokens=max_num_tokens), engine.config.model_dump())
    return Executor(engine.model, build, kv_cache_config=KvCacheConfig(enable_block_reuse=reuse))


def greedy(new_tokens: int) -> SamplingConfig:
    """Greedy sampling of exactly `new_tokens` tokens."""
    return SamplingConfig(temperature=0.0, ignore_eos=True, max_new_tokens=new_tokens)


def drive(ex: Executor, target: Request, seen: dict[int, list[torch.Tensor]],
          arrivals: dict[int, list[list[int]]] | None = None, new_tokens: int = 8) -> Run:
    """Step `ex` until idle, adding arrivals[s] (prompts) before step s; `target`'s run."""
    step = 0
    while ex.has_work or any(s >= step for s in (arrivals or {})):
        for prompt in (arrivals or {}).get(step, []):
            ex.add(prompt, greedy(new_tokens))
        ex.step()
        step += 1
    return Run(list(target.output), seen[target.id])


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts of these lengths (ids 1 .. vocab - 1)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def run_alone(engine: Engine, prompt: list[int], new_tokens: int) -> Run:
    """The request alone: a fresh executor, no reuse, the prompt in one step."""
    ex = executor(engine)
    seen = recording(ex)
    return drive(ex, ex.add(prompt, greedy(new_tokens)), seen)


def run_batch(engine: Engine, prompt: list[int], new_tokens: int, seed: int = 1) -> Run:
    """The request with 5 others of mixed lengths at once, then long prompts arriving while it decodes."""
    vocab = engine.config.vocab_size
    ex = executor(engine)
    seen = recording(ex)
    first = prompts(vocab, [3, 17, 40, len(prompt) + 9, 130], seed)
    target = ex.add(prompt, greedy(new_tokens))
    for p in first:
        ex.add(p, greedy(new_tokens + 4))
    arrivals = {2: prompts(vocab, [200, 1], seed + 1), 4: prompts(vocab, [160, 33], seed + 2)}
    return drive(ex, target, seen, arrivals, new_tokens)


def run_reused(engine: Engine, prompt: list[int], new_tokens: int) -> Run:
    """The request on an executor with prefix reuse that has just run it: its full blocks reused."""
    ex = executor(engine, reuse=True)
    seen = recording(ex)
    drive(ex, ex.add(prompt, greedy(new_tokens)), seen)
    return drive(ex, ex.add(prompt, greedy(new_tokens)), seen)


def run_chunked(engine: Engine, prompt: list[int], new_tokens: int, chunk: int = 48) -> Run:
    """The request on an executor whose steps hold at most `chunk` tokens."""
    ex = executor(engine, max_num_tokens=chunk)
    seen = recording(ex)
    return drive(ex, ex.add(prompt, greedy(new_tokens)), seen)


def agreement(ref: Run, other: Run) -> Agreement:
    """`other` against `ref`: equal tokens before the first difference, max |logit diff| up to it."""
    equal = next((i for i, (a, b) in enumerate(zip(ref.tokens, other.tokens)) if a != b), len(ref.tokens))
    steps = min(equal + 1, len(ref.logits), len(other.logits))
    diff = max(((a - b).abs().max().item() for a, b in zip(ref.logits[:steps], other.logits[:steps])), default=0.0)
    return Agreement(equal, len(ref.tokens), float(diff))


def streams(engine: Engine, count: int, new_tokens: int = 16, seed: int = 5) -> list[Agreement]:
    """`count` greedy requests (prompts of 16 to 300 tokens) in one executor at once against each alone."""
    rng = random.Random(seed)
    batch = prompts(engine.config.vocab_size, [rng.randint(16, 300) for _ in range(count)], seed)
    ex = executor(engine, batch=count)
    seen = recording(ex)
    reqs = [ex.add(p, greedy(new_tokens)) for p in batch]
    while ex.has_work:
        ex.step()
    return [agreement(run_alone(engine, p, new_tokens), Run(list(r.output), seen[r.id])) for p, r in zip(batch, reqs)]


def compare(engine: Engine, prompt: list[int], new_tokens: int = 8, chunk: int = 48,
            ways: tuple[str, ...] = WAYS) -> dict[str, Agreement]:
    """Each of `ways` (batch, reused, chunked, alone: a second run alone) against the request alone."""
    runs = {"batch": lambda: run_batch(engine, prompt, new_tokens),
            "reused": lambda: run_reused(engine, prompt, new_tokens),
            "chunked": lambda: run_chunked(engine, prompt, new_tokens, chunk),
            "alone": lambda: run_alone(engine, prompt, new_tokens)}
    ref = run_alone(engine, prompt, new_tokens)
    return {way: agreement(ref, runs[way]()) for way in ways}
