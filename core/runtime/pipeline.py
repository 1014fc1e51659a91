"""Pipeline parallelism: each stage runs its layers on micro-batches and hands the hidden states on.

Ranks are stage-major: global rank = pp_rank * tp_size + tp_rank (core.format.config.Mapping);
stage s holds the layers `pp_layer_range(L, P, s)`, stage 0 the token embedding, the last stage
ln_f and lm_head. Every rank receives the same Step (core.runtime.step_broadcast), so every rank
knows the step's sequences; `DecoderLM.forward` then runs `pipeline_forward` on each rank:

    the step's B sequences -> M micro-batches of whole sequences (contiguous, balanced by tokens)
    stage 0      for m in 0..M-1: x_m = embed(ids_m) -> its layers -> isend x_m to (1, tp_rank)
    stage s      for m in 0..M-1: recv x_m from (s-1, tp_rank) -> its layers -> isend to (s+1, tp_rank)
    last stage   for m in 0..M-1: recv x_m -> its layers -> ln_f -> logits_m (gathered over its tp
                 ranks) -> tp rank 0 isends logits_m to rank 0
    rank 0       after its own micro-batches: recv logits_m for every m -> concat -> [B, V] ([T, V])

Tensor parallelism inside a stage runs on that stage's own group (`stage_tp_group`): the
all-reduces of stage s never wait for another stage. Each tp rank of a stage sends its own
(identical, already all-reduced) hidden state to the same tp rank of the next stage.

Schedule (GPipe's forward fill and drain; inference has no backward): stage s works on
micro-batch m in time slot s + m, so a step of M equal micro-batches on P stages takes
M + P - 1 slots and each stage idles in P - 1 of them:

    bubble = (P - 1) / (M + P - 1)        (P 2, M 4: 20%;  M 1, a batch-1 decode: 50%)

Decode micro-batches run as each stage's compiled CPU plan (core.runtime.cpu_plan: no embedding after
stage 0, no logits before the last). A decode step cannot overlap with the next one (its tokens are sampled from this step's
logits), so the bubble is paid every step; more micro-batches shrink it but make each
stage's matmuls narrower and repeat each layer's fixed overhead: M = min(B, 2 * P, T // 64) for a
step of T tokens (BESTIARY_PP_MICRO_BATCHES overrides), read on the driver and sent with the step
(meta.micro_batches), so every stage cuts the same ranges. `PipelineStats`
measures the real fraction per rank (time inside this rank's own compute / step wall time).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.runtime.model import last_tokens

_STAGE_GROUPS: dict[tuple, list] = {}  # (world group, tp, pp) -> the tp group of each stage


def stage_tp_group(tp_size: int, pp_size: int, rank: int):
    """The process group of the tp ranks of `rank`'s stage (None: the default world, when pp is 1).

    `dist.new_group` is collective over the whole world, so every rank creates every stage's group,
    in stage order, on its first call for this (tp, pp) layout (Engine.load runs on all ranks)."""
    if pp_size == 1 or tp_size == 1:
        return None  # tp 1: no collectives inside a stage
    key = (id(dist.group.WORLD), tp_size, pp_size)
    if key not in _STAGE_GROUPS:
        _STAGE_GROUPS[key] = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
    return _STAGE_GROUPS[key][rank // tp_size]


def micro_batches(seq_lens: list[int], count: int) -> list[tuple[int, int]]:
    """Split sequences 0..B-1 into at most `count` contiguous, non-empty ranges [a, b) whose token
    counts are as even as a greedy cut allows (a prefill of one long prompt stays one range)."""
    count = max(1, min(count, len(seq_lens)))
    total, ranges, start, done = sum(seq_lens), [], 0, 0
    for m in range(count):
        if m == count - 1:
            ranges.append((start, len(seq_lens)))
            break
        target = total * (m + 1) / count
        end = start + 1  # at least one sequence each
        done += seq_lens[start]
        while end < len(seq_lens) - (count - 1 - m) and done + seq_lens[end] / 2 <= target:
            done += seq_lens[end]
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def slice_meta(meta: AttentionMetadata, a: int, b: int) -> tuple[AttentionMetadata, int, int]:
    """The metadata of sequences [a, b) of a step, and their token range [ta, tb) in the packed ids."""
    ta, tb = sum(meta.seq_lens[:a]), sum(meta.seq_lens[:b])
    seq_lens = meta.seq_lens[a:b]
    part = AttentionMetadata(
        positions=meta.positions[..., ta:tb],
        seq_lens=list(seq_lens),
        context_lens=list(meta.context_lens[a:b]),
        block_tables=meta.block_tables[a:b],
        slot_mapping=meta.slot_mapping[ta:tb],
        block_size=meta.block_size,
        mask=meta.mask,
        prefix_lens=None if meta.prefix_lens is None else list(meta.prefix_lens[a:b]),
        last_token_index=torch.tensor(seq_lens, dtype=torch.int64).cumsum(0).sub_(1).to(meta.slot_mapping.device),
        windows=None if meta.windows is None else list(meta.windows[a:b]),
        sinks=None if meta.sinks is None else list(meta.sinks[a:b]),
        contiguous_from=list(meta.contiguous_from[a:b]) if meta.contiguous_from else [],
        micro_batches=1,
        lora=None if meta.lora is None else _slice_lora(meta.lora, a, b),
    )
    return part, ta, tb


def _slice_lora(lora, a: int, b: int):
    """The step's adapters (a core.lora.batch.StepLora) for sequences [a, b): same stack, their slots."""
    from bestiary.core.lora.batch import StepLora

    return StepLora(lora.stack, lora.seq_lens[a:b], lora.slots[a:b])


MICRO_BATCH_TOKENS = 64  # fewest tokens worth a micro-batch of their own (below, per-layer overhead wins)


def micro_batch_count(seq_lens: list[int], pp_size: int) -> int:
    """M for a step: BESTIARY_PP_MICRO_BATCHES if set, else 2 * pp_size, at most one per sequence and one
    per MICRO_BATCH_TOKENS tokens of the step (a batched decode of 16 sequences runs whole: cut in four,
    each stage would pay its per-layer overhead four times for a shorter bubble)."""
    wanted = os.environ.get("BESTIARY_PP_MICRO_BATCHES", "")
    if wanted and (not wanted.isdigit() or int(wanted) < 1):
        raise BestiaryError(f"BESTIARY_PP_MICRO_BATCHES={wanted!r}: expected a positive integer")
    if wanted:
        return min(len(seq_lens), int(wanted))
    return max(1, min(len(seq_lens), 2 * pp_size, sum(seq_lens) // MICRO_BATCH_TOKENS))


@dataclass
class PipelineStats:
    """Per rank: steps run, their wall time, and the time spent in this rank's own compute."""

    steps: int = 0
    wall_s: float = 0.0
    busy_s: float = 0.0
    micro_batches: int = 0

    @property
    def bubble(self) -> float:
        """Fraction of step time this rank waited on its neighbours (1 - busy / wall)."""
        return 0.0 if self.wall_s == 0 else 1.0 - self.busy_s / self.wall_s

    def to_json(self) -> dict:
        return {"steps": self.steps, "wall_s": round(self.wall_s, 6), "busy_s": round(self.busy_s, 6),
                "micro_batches": self.micro_batches, "bubble": round(self.bubble, 4)}


@dataclass
class _Sends:
    """Outstanding isends of a step (their tensors must live until they complete)."""

    works: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self.tensors.append(tensor)
        self.works.append(dist.isend(tensor, dst))

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A tensor as gloo carries it (bf16 travels as its int16 bits)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, device) -> torch.Tensor:
    """Receive a [shape] tensor of `dtype` from global rank `src`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(_wire(out), src)
    return out


def pipeline_forward(model, ids: torch.Tensor, meta: AttentionMetadata, kv_cache, all_logits: bool = False):
    """One step of `model` (this rank's stage) over micro-batches; the logits [B or T, V] on
    global rank 0, None on every other rank."""
    stats = model.__dict__.setdefault("pipeline_stats", PipelineStats())
    begin, busy = time.perf_counter(), 0.0
    tp, stage, rank = model.tp_size, model.pp_rank, model.rank
    prev_rank, next_rank = rank - tp, rank + tp  # same tp rank, neighbouring stage
    hidden, device = model.config.hidden_size, ids.device
    count = meta.micro_batches or micro_batch_count(meta.seq_lens, model.pp_size)  # the driver's choice
    ranges = micro_batches(meta.seq_lens, count)
    sends, logits_shapes = _Sends(), []
    vocab, logits_dtype = model.config.vocab_size, _logits_dtype(model)
    for a, b in ranges:
        part, ta, tb = slice_meta(meta, a, b)
        rows = tb - ta if all_logits else b - a
        logits_shapes.append((rows, vocab))
        x = None if model.is_first_stage else _recv((tb - ta, hidden), model.dtype, prev_rank, device)
        t0 = time.perf_counter()
        plan = None if all_logits else model._decode_plan(ids[ta:tb], part, kv_cache)  # this stage's compiled decode
        if plan is not None:
            x = plan.run(ids[ta:tb], part, x)  # [B_m, H], or the last stage's logits [B_m, V]
            if model.is_last_stage:
                busy += time.perf_counter() - t0
                if model.tp_rank == 0:
                    sends.send(_wire(x), 0)
                continue
        else:
            x = model.embed(ids[ta:tb], part) if x is None else x  # [T_m, H]
            for i, layer in enumerate(model.transformer.layers):
                x = layer(x, part, kv_cache.k[i], kv_cache.v[i])
        if not model.is_last_stage:
            busy += time.perf_counter() - t0
            _check_hidden(x, tb - ta, hidden, model.dtype, stage)
            sends.send(_wire(x), next_rank)
            continue
        if not all_logits:
            x = x.index_select(0, last_tokens(part))  # [B_m, H]
        out = model.logits(model.transformer.ln_f(x))  # [rows, V], gathered over the stage's tp ranks
        busy += time.perf_counter() - t0
        if model.tp_rank == 0:
            sends.send(_wire(out), 0)
    result = None
    if rank == 0:
        result = torch.cat([_recv(shape, logits_dtype, (model.pp_size - 1) * tp, device) for shape in logits_shapes])
    sends.wait()
    stats.steps += 1
    stats.micro_batches += len(ranges)
    stats.busy_s += busy
    stats.wall_s += time.perf_counter() - begin
    return result


def _logits_dtype(model) -> torch.dtype:
    from bestiary.core.runtime.model import torch_dtype

    return torch_dtype(model.config.logits_dtype)


def _check_hidden(x: torch.Tensor, tokens: int, hidden: int, dtype: torch.dtype, stage: int) -> None:
    """The hidden state a stage hands on is [tokens, hidden_size] in the model dtype (what the next one receives)."""
    if tuple(x.shape) != (tokens, hidden) or x.dtype != dtype:
        raise BestiaryError(f"pipeline stage {stage}: its layers returned {tuple(x.shape)} {x.dtype}, expected "
                            f"({tokens}, {hidden}) {dtype} to send to the next stage")
