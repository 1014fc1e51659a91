"""`bestiary eval`: perplexity of an engine over a token sequence.

PPL = exp(mean over t of -log p(x_t | x_<t)), over windows of at most max_seq_len tokens
(each window starts with an empty cache), fed in chunks of max_num_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.kv_cache import KVCache, blocks_for
from bestiary.core.runtime.model import sequence_metadata


@dataclass
class Perplexity:
    tokens: int  # predicted tokens
    nll: float  # mean negative log-likelihood (nats)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@torch.inference_mode()
def window_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one window, computed chunk by chunk through a private KV cache."""
    model, build = engine.model, engine.build
    bs = build.tokens_per_block
    blocks = list(range(blocks_for(len(ids), bs)))
    kv = KVCache.for_model(model, len(blocks), bs)
    device = kv.k.device
    out = []
    for start in range(0, len(ids), build.max_num_tokens):
        chunk = ids[start : start + build.max_num_tokens]
        meta = sequence_metadata(model, ids, start, len(chunk), blocks, bs, device)  # the window is the prompt
        out.append(model(torch.tensor(chunk, device=device), meta, kv, all_logits=True).float().cpu())
    return torch.cat(out)


def check_input_ids(engine: Engine, ids: list[int]) -> None:
    """Every id is a row of the embedding, [0, vocab_size), before any lookup: else one line naming the id
    (and the tokenizer file, which made the ids)."""
    vocab = engine.config.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is None:
        return
    where = f"{engine.tokenizer.source}: " if engine.tokenizer is not None else ""
    raise BestiaryError(f"{where}token id {bad} is outside the model's vocabulary [0, {vocab}) "
                        f"({engine.directory / 'config.json'}: vocab_size); use the model's own tokenizer")


def perplexity(engine: Engine, ids: list[int]) -> Perplexity:
    """Perplexity of `ids` under the engine's model."""
    if len(ids) < 2:
        raise BestiaryError("eval needs a text of at least 2 tokens")
    check_input_ids(engine, ids)
    window = engine.max_seq_len
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = window_logits(engine, chunk)
        targets = torch.tensor(chunk[1:])
        total += torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum").item()
        count += len(chunk) - 1
    return Perplexity(count, total / count)
