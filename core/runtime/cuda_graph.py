"""Decode steps on a CUDA device replayed from captured CUDA graphs.

A decode step of B sequences launches a few hundred small kernels (per layer: norms, GEMMs, rotary,
the KV write, attention, the activation). Launched one by one from Python, their launch cost is
several times their run time at batch 1; a CUDA graph replays all of them with one launch.

A graph is captured once per batch size B and KV cache, over static device buffers:

    ids [B], positions [B], slot_mapping [B]       int64   this step's tokens and where their K/V go
    block_tables [B, W]                            int64   W = the pool's block count (any table fits)
    kv_lens [B]                                    int32   keys each sequence attends to after the write
    logits [B, V]                                          the graph's output

Each step copies its metadata into the buffers (rows past a table's length keep stale entries the
kernel never reads: it stops at kv_lens) and replays; the logits come back as a copy. The first
step of a batch size runs the model eagerly once (Triton compiles, the rotary tables are sized for
the whole pool), then captures and replays.

What a graph cannot follow is refused, and those steps run eagerly (`refusal` says why): a per-step
LoRA or per-sequence windows, the "torch" kernel mode, BESTIARY_CUDA_GRAPHS=0; and for good
(`model_refusal`, kept in `model.__dict__["cuda_graph_refusal"]`) a prefix-LM mask or positions of
the architecture's own (ChatGLM v1's 2D positions), a key bias (its length is read from the step),
an attention logit soft-cap (Gemma 2: the torch path, per sequence), tp or pp > 1, and a capture that failed
(an op that syncs the device, e.g. a data-dependent shape).
"""

from __future__ import annotations

import os

import torch

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.attention import PagedAttention
from bestiary.core.layers.rotary import Rotary

ENV_VAR = "BESTIARY_CUDA_GRAPHS"  # "0" turns graphs off
MAX_GRAPHS = 32  # batch sizes kept captured per model (the oldest is dropped past this)


def enabled() -> bool:
    """False when BESTIARY_CUDA_GRAPHS=0."""
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "off", "false")


def refusal(model, ids: torch.Tensor, meta: AttentionMetadata) -> str | None:
    """None when this step may replay a graph, else why it runs eagerly."""
    if not ids.is_cuda or not meta.is_decode:
        return "not a CUDA decode step"
    if not enabled():
        return f"{ENV_VAR}=0"
    if dispatch.mode() == "torch":
        return "kernel mode torch"
    if meta.lora is not None or meta.windows is not None:
        return "a LoRA or per-sequence windows in this step"
    return model_refusal(model)


def model_refusal(model) -> str | None:
    """None when the model's decode steps may replay graphs, else why never (checked once per model)."""
    if "cuda_graph_refusal" not in model.__dict__:
        from bestiary.core.runtime.model import DecoderLM

        keyed = any(m.key_bias is not None for m in model.modules() if isinstance(m, PagedAttention))
        capped = any(m.softcap is not None or m.sink_logits is not None  # both: the per-sequence torch path
                     for m in model.modules() if isinstance(m, PagedAttention))
        model.__dict__["cuda_graph_refusal"] = (
            "tp or pp > 1" if model.tp_size > 1 or model.pp_size > 1
            else "a prefix-LM mask" if model.mask_kind != "causal"
            else "positions of the architecture's own" if type(model).position_ids is not DecoderLM.position_ids
            else "a key bias (its length is read from each step)" if keyed
            else "an attention logit soft-cap or sink logits (their torch path reads each step's lengths)" if capped
            else None)
    return model.__dict__["cuda_graph_refusal"]


class DecodeGraph:
    """One captured decode step of `batch` sequences over one KV cache's pools."""

    def __init__(self, model, batch: int, kv_cache, pool=None) -> None:
        self.model, self.batch, self.kv = model, batch, kv_cache
        device = kv_cache.k.device
        num_blocks, block_size = kv_cache.k.shape[1], kv_cache.k.shape[2]
        self.block_size = block_size
        as_long = {"dtype": torch.int64, "device": device}
        self.ids = torch.zeros(batch, **as_long)
        self.positions = torch.zeros(batch, **as_long)
        self.slots = torch.zeros(batch, **as_long)
        self.tables = torch.zeros(batch, num_blocks, **as_long)
        self.kv_lens = torch.ones(batch, dtype=torch.int32, device=device)
        self.last = torch.arange(batch, **as_long)
        for module in model.modules():
            if isinstance(module, Rotary):  # every position the pool can hold: no table growth later
                module.reserve(device, num_blocks * block_size)
        self.graph: torch.cuda.CUDAGraph | None = None  # once captured
        self.pool = pool
        self.logits: torch.Tensor | None = None

    def static_meta(self) -> AttentionMetadata:
        """A fresh metadata over the static buffers (its step cache empty, so captured ops recompute
        what they cache per step from the buffers)."""
        b = self.batch
        meta = AttentionMetadata(positions=self.positions, seq_lens=[1] * b, context_lens=[0] * b,
                                 block_tables=self.tables, slot_mapping=self.slots, block_size=self.block_size,
                                 last_token_index=self.last)
        ones = torch.ones(b, dtype=torch.int32, device=self.ids.device)
        meta._kernel_args[self.ids.device] = dict(q_start=self.last.to(torch.int32), seq_len=ones, ctx_len=self.kv_lens - 1,
                                                  prefix=ones * 0, kv_len=self.kv_lens, table=self.tables)
        return meta

    def load(self, ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy this step's tokens and metadata into the static buffers."""
        width = meta.block_tables.shape[1]
        self.ids.copy_(ids, non_blocking=True)
        self.positions.copy_(meta.positions, non_blocking=True)
        self.slots.copy_(meta.slot_mapping, non_blocking=True)
        self.tables[:, :width].copy_(meta.block_tables, non_blocking=True)
        self.kv_lens.copy_(torch.tensor(meta.kv_lens, dtype=torch.int32), non_blocking=True)

    def capture(self) -> None:
        """Run the loaded step eagerly once on a side stream (Triton compiles), then capture it."""
        forward = self.model.eager_forward
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(self.ids, self.static_meta(), self.kv)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.logits = forward(self.ids, self.static_meta(), self.kv)

    def run(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """logits [B, V] of this step (a copy: the next replay overwrites the graph's)."""
        assert self.graph is not None and self.logits is not None, "graph_for captures a graph before running it"
        self.load(ids, meta)
        self.graph.replay()
        return self.logits.clone()


def graph_for(model, ids: torch.Tensor, meta: AttentionMetadata, kv_cache) -> DecodeGraph | None:
    """The captured graph for this step's batch size and KV cache (captured now if new), or None when
    the step runs eagerly (`refusal`, or a capture that failed: the model is then refused for good)."""
    if refusal(model, ids, meta) is not None:
        return None
    graphs: dict[int, DecodeGraph] = model.__dict__.setdefault("_cuda_graphs", {})
    batch = len(meta.seq_lens)
    graph = graphs.get(batch)
    if graph is not None and graph.kv is kv_cache:
        return graph
    if len(graphs) >= MAX_GRAPHS:
        graphs.pop(next(iter(graphs)))
    pool = model.__dict__.setdefault("_cuda_graph_pool", torch.cuda.graph_pool_handle())
    graph = DecodeGraph(model, batch, kv_cache, pool)
    graph.load(ids, meta)
    try:
        graph.capture()
    except Exception as err:  # an op the capture refuses: eager from now on, and why
        model.__dict__["cuda_graph_refusal"] = f"capture failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        torch.cuda.synchronize()
        return None
    graphs[batch] = graph
    return graph
