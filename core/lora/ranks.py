"""LoRA on a multi-rank (tensor-parallel) engine: each driver step carries its adapters to every rank.

The driver's cache (core.lora.cache) holds the adapters and places them on rank 0. A step
with adapters sends, next to the step's token counts, a `LoraStep`:

    adapters   (name, uid) of each stack slot, in slot order
    slots      the slot of each sequence (-1: the base model);  seq_lens its new tokens
    sources    uid -> LoraSource (every rank's weights) for the uids not sent before
    drop       uids the ranks forget (the sender keeps at most `keep` uids sent)

and each rank places a new source on its own shard (core.lora.adapter.place: a column-parallel
linear keeps its rows of B and the whole A, a row-parallel one its columns of A and the whole
B, TensorRT-LLM's TP rule), stacks the step's adapters and runs the same StepLora as rank 0, so

    column-parallel:  y_r = W_r x + s B_r (A x)        (rank r's rows of the output)
    row-parallel:     y = sum_r (W_r x_r + s B (A_r x_r))   (the linear's all-reduce sums the parts)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from bestiary.core.lora.adapter import LoraAdapter, LoraSource, place
from bestiary.core.lora.batch import AdapterStack, StepLora

KEEP = 64  # uids a rank keeps placed (the driver's cache decides what stays; this bounds the ranks)
STACKS = 8


@dataclass
class LoraStep:
    """The LoRA part of one driver step (module docstring)."""

    adapters: list[tuple[str, int]]
    seq_lens: list[int]
    slots: list[int]
    sources: dict[int, LoraSource] = field(default_factory=dict)
    drop: list[int] = field(default_factory=list)


class LoraSender:
    """The driver's side: which uids the ranks hold."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.sent: OrderedDict[int, None] = OrderedDict()

    def message(self, step: StepLora) -> LoraStep:
        adapters: tuple[LoraAdapter, ...] = step.stack.adapters
        msg = LoraStep([(a.name, a.uid) for a in adapters], list(step.seq_lens), list(step.slots))
        for adapter in adapters:
            if adapter.uid not in self.sent:
                if adapter.source is None:
                    raise ValueError(f"LoRA adapter {adapter.name!r} has no source to send to the other ranks")
                msg.sources[adapter.uid] = adapter.source
            self.sent[adapter.uid] = None
            self.sent.move_to_end(adapter.uid)
        used = {a.uid for a in adapters}
        while len(self.sent) > max(self.keep, len(used)):
            old = next(u for u in self.sent if u not in used)
            del self.sent[old]
            msg.drop.append(old)
        return msg


class LoraReceiver:
    """A rank's side: the adapters placed on its shard by uid, and the step's StepLora."""

    def __init__(self, model) -> None:
        self.model = model
        self.adapters: dict[int, LoraAdapter] = {}
        self._stacks: OrderedDict[tuple[int, ...], AdapterStack] = OrderedDict()

    def step(self, msg: LoraStep, device: torch.device | str) -> StepLora:
        for uid in msg.drop:
            self.adapters.pop(uid, None)
            self._stacks = OrderedDict((k, s) for k, s in self._stacks.items() if uid not in k)
        for uid, source in msg.sources.items():
            self.adapters[uid] = place(source, self.model)
        key = tuple(uid for _, uid in msg.adapters)
        stack = self._stacks.pop(key, None) or AdapterStack([self.adapters[u] for u in key], self.model.dtype, device)
        self._stacks[key] = stack
        while len(self._stacks) > STACKS:
            self._stacks.popitem(last=False)
        return StepLora(stack, msg.seq_lens, msg.slots)
