"""One step's packed batch as attention (and every other op of the step) reads it.

Inputs are packed: the tokens of all sequences of a step, one after the other, [T, ...].
Sequence i contributes seq_lens[i] new tokens and already has context_lens[i] tokens in
the KV cache. Keys/values of the new tokens go to the pool slots in `slot_mapping`; key j
of sequence i lives in block block_tables[i, j // block_size] at offset j % block_size.
The attention references (core.kernels.attention_ref) and kernels (core.kernels.attention,
core.kernels.cpu) read it; layers pass it down unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from bestiary.core.kernels.attention_window import FULL, effective_window, windows_of

# Additive per-head bias of key positions: k_pos [L] (int64) -> [H_local, L] (float32).
KeyBias = Callable[[torch.Tensor], torch.Tensor]


class LoraDelta(Protocol):
    """Per-step batched LoRA (core.lora.batch.StepLora): the delta y_lora [T, out] for input x [T, in]
    of `module` (a core.layers.linear.Linear), None when no adapter of the step touches it."""

    def __call__(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None: ...

    def concat(self, modules: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor | None:
        """The deltas of linears reading the same x, side by side [T, sum out] (a fused fc + gate)."""
        ...


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about one step's packed batch.

    positions: [T] (or [2, T] for ChatGLM v1's 2D positions) position ids per token.
    seq_lens / context_lens: new tokens and cached tokens per sequence (length B).
    block_tables: [B, max_blocks] int64 indices into the KV pool's blocks.
    slot_mapping: [T] int64 flat slot (block * block_size + offset) of each new token.
    mask: "causal" or "prefix_lm" (bidirectional over the first prefix_lens[i] tokens).
    last_token_index: [B] index in the packed tokens of each sequence's last new token.
    lora: batched LoRA delta for this step, or None.
    windows / sinks: per-sequence attention window cap and sink tokens (core.kernels.attention_window;
    window 0 = none), or None: no sequence has one. A layer's own window narrows it (`window_bounds`).
    """

    positions: torch.Tensor
    seq_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    mask: str = "causal"
    prefix_lens: list[int] | None = None
    last_token_index: torch.Tensor | None = None
    lora: LoraDelta | None = None
    windows: list[int] | None = None
    sinks: list[int] | None = None
    # First block of each sequence whose blocks sit one after another in the pool (None
    # otherwise): its keys are then a view of the pool, no gather needed.
    contiguous_from: list[int | None] = field(default_factory=list)
    micro_batches: int | None = None  # pipeline parallelism: how many micro-batches the driver cut the step into
    keep_hidden: bool = False  # the executor pools embeddings: the model keeps the final-norm rows in `hidden`
    hidden: torch.Tensor | None = None  # [T, H] ln_f output of every new token (with all_logits and keep_hidden)
    _decode_padding: dict = field(default_factory=dict, repr=False)
    _step_cache: dict = field(default_factory=dict, repr=False)  # per-step values shared by all layers
    _kernel_args: dict = field(default_factory=dict, repr=False)  # Triton's per-sequence tensors, by device

    @property
    def kv_lens(self) -> list[int]:
        """Keys each sequence attends to after this step's write."""
        return [c + s for c, s in zip(self.context_lens, self.seq_lens)]

    @property
    def is_decode(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return all(s == 1 for s in self.seq_lens)

    @classmethod
    def build(
        cls,
        seq_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        positions: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        **kwargs,
    ) -> AttentionMetadata:
        """Metadata for sequences with `seq_lens` new tokens after `context_lens` cached ones.

        positions default to context_len + arange(seq_len) per sequence.
        """
        pos_list: list[int] = []
        slots: list[int] = []
        for n, ctx, table in zip(seq_lens, context_lens, block_tables):
            for p in range(ctx, ctx + n):
                pos_list.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        if positions is not None:
            positions = positions.to(device)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        kv_lens = [c + n for c, n in zip(context_lens, seq_lens)]
        contiguous = [_contiguous_start(t, -(-kv // block_size)) for t, kv in zip(block_tables, kv_lens)]
        ends = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0) - 1
        return cls(
            positions=torch.tensor(pos_list, dtype=torch.int64, device=device) if positions is None else positions,
            seq_lens=list(seq_lens),
            context_lens=list(context_lens),
            # entries < 0 (blocks released out of a window, never read) point at block 0: a valid index
            block_tables=torch.tensor(padded, dtype=torch.int64).clamp_(min=0).to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            last_token_index=ends.to(device),
            contiguous_from=contiguous,
            **kwargs,
        )

    def window_bounds(self, layer_window: int) -> tuple[list[int], list[int]] | None:
        """(windows, sinks) per sequence for a layer whose own window is `layer_window` (0: none),
        or None when no sequence of the step has a window in that layer (plain causal attention)."""
        if layer_window == FULL and self.windows is None:
            return None

        def make():
            requested = self.windows or [FULL] * len(self.seq_lens)
            sizes = [effective_window(layer_window, w) for w in requested]
            if not windows_of(sizes):
                return None
            return sizes, [s if w != FULL else 0 for s, w in zip(self.sinks or [0] * len(sizes), sizes)]

        return self.step_value(("window", layer_window), lambda: make() or False) or None

    def step_value(self, key, make):
        """`make()` once per step for `key` (e.g. rotary cos/sin shared by every layer)."""
        value = self._step_cache.get(key)
        if value is None:
            value = self._step_cache[key] = make()
        return value

    def decode_padding(self, length: int, device: torch.device) -> torch.Tensor | None:
        """[B, L] True at the key slots past each sequence's length in a batched decode (None for B == 1).

        Those slots hold whatever the pool held (never-written memory may be NaN), so they are
        masked out of both the scores and V, never only biased by -inf.
        """
        if len(self.seq_lens) == 1:
            return None
        key = (length, device)
        if key not in self._decode_padding:
            lens = torch.tensor(self.kv_lens, device=device)
            self._decode_padding[key] = torch.arange(length, device=device)[None, :] >= lens[:, None]
        return self._decode_padding[key]


def _contiguous_start(table: list[int], num_blocks: int) -> int | None:
    """table[0] when table[:num_blocks] is table[0], table[0] + 1, ... (else None)."""
    if not table or num_blocks == 0:
        return None
    first = table[0]
    return first if table[:num_blocks] == list(range(first, first + num_blocks)) else None
