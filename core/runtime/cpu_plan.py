"""A whole CPU decode step as one list of compiled ops, run by one call (no Python per layer).

On a 135M-parameter model a decode step is ~400 small ops; run one by one from Python their
overhead (~20 ms a step here) costs more than the matmuls. A `DecodePlan` walks a model built
from the shared layers once and writes the step down as records of kernels.c's ops, with every
pointer fixed: the weights, the KV pools and preallocated activations. What changes per step
(token ids, positions, kv lengths, block tables, slots) is copied into buffers the records
point at, then `bst_run_plan` runs the list. The math is the eager path's, op for op:

    x = embed(ids)
    per layer:  y = rms_norm(x [+= pending mlp output]);  qkv = y Wqkv^T;  [q_h, k_h = rms_norm(q_h), rms_norm(k_h)
                per head (QK-norm, in place)];  rotary(q, k)
                write k, v to the pool;  o = attention(q, pool);  a = o Wo^T
                y = rms_norm(x += a);  fg = y [Wfc; Wgate]^T;  m = act(f) * g;  d = m Wproj^T
    logits = rms_norm(x += d) W_lm^T

LoRA: after each linear that adapters may touch (qkv, dense, fused fc + gate, proj) a LoRA
record (kernels.c bst_lora_rows) adds to its output buffer each row's own adapter's update,
out[t] += ((y[t] A_a^T) * s_a) B_a^T for a = the row's adapter (none: the row is left alone).
With meta.lora (a core.lora.batch.StepLora) the records point at its stack's per-row layouts
(Site.rows; re-pointed only when the step's stack changes) and a [B] buffer gets each row's
adapter; without, every row's is -1. The step stays one compiled call.

Attention windows (core.kernels.attention_window): each attention record reads a [3, B] row
block of its layer's window (kv lengths | windows | sinks), filled per step from
meta.window_bounds; block tables may be wider than the pool (blocks released out of a window).

KV pools may be float or INT8 / FP8 codes (core.quant.kv; written and read with the layer's
(s_k, s_v)). `plan_for(model, batch, k_pools, v_pools)` returns None for anything else: other
layer types, key-bias functions, a parallel embedding at tp > 1, an overridden
embed / logits / position_ids, weights the kernels do not read, modules with forward hooks
(a plan calls no module: hooks registered after a model's first decode step are not seen).
The eager path runs those. Under tensor parallelism each rank's plan stops after every
row-parallel linear to all-reduce (its stage's group); a pipeline stage's plan starts from the
hidden state it is given (no embedding) and, before the last stage, returns x after its layers.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import weakref
from collections.abc import Callable

import torch

from bestiary.core.kernels.activations_ref import ACT_CODES
from bestiary.core.kernels.cpu import ops
from bestiary.core.kernels.cpu.build import library

OP_EMBED, OP_RMS_NORM, OP_LINEAR, OP_ROTARY, OP_KV_WRITE, OP_ATTENTION, OP_ACT_MUL, OP_LORA, OP_HEAD_NORM = range(9)
# which i[] of each op's record holds its number of rows (the batch): DecodePlan.resized sets it
BATCH_FIELD = {OP_EMBED: 0, OP_RMS_NORM: 0, OP_LINEAR: 0, OP_ROTARY: 0, OP_KV_WRITE: 0, OP_ATTENTION: 1,
               OP_ACT_MUL: 0, OP_LORA: 0, OP_HEAD_NORM: 0}
# decode steps of up to this many sequences run as a plan: 1.7x eager at 32; with float weights in
# row tiles (whose eager GEMMs put rows back in order each step) bf16 SmolLM2 steps of 48 / 64 / 96 /
# 128 sequences took 76 / 96 / 118 / 163 ms as plans against 96 / 106 / 127 / 176 eager on W^T
MAX_BATCH = 128


class Op(ctypes.Structure):
    """kernels.c's bst_op: an op code, dtypes, pointers, integers and floats."""

    _fields_ = [("op", ctypes.c_int64), ("dt", ctypes.c_int64 * 4), ("p", ctypes.c_void_p * 8),
                ("i", ctypes.c_int64 * 8), ("f", ctypes.c_float * 2)]


class Unsupported(Exception):
    """The model has something a plan cannot express (the eager path runs it)."""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _dt(t: torch.Tensor) -> int:
    if t.dtype not in ops.DTYPES:
        raise Unsupported(f"dtype {t.dtype}")
    return ops.DTYPES[t.dtype]


def _kv_dt(pool: torch.Tensor, kv_scales: torch.Tensor | None) -> int:
    """The dtype code of a KV pool: float (no scales) or INT8 / FP8 codes (with scales)."""
    try:
        return ops.kv_dtype_code(pool, kv_scales)
    except ValueError as err:
        raise Unsupported(str(err)) from None


def _op(code: int, dt=(), p=(), i=(), f=()) -> Op:
    o = Op()
    o.op = code
    for j, v in enumerate(dt):
        o.dt[j] = v
    for j, v in enumerate(p):
        o.p[j] = v
    for j, v in enumerate(i):
        o.i[j] = v
    for j, v in enumerate(f):
        o.f[j] = v
    return o


class StepBuffers:
    """The activation buffers of a model's plans: one [capacity, width] tensor per (name, width, dtype),
    of which a plan of b <= capacity sequences uses rows [:b] (a contiguous prefix).

    Every layer of a plan writes the same qkv / o / fc+gate / act buffers (the layers run one after the
    other), and every plan of the model shares them, so a step's activations stay in cache and a plan
    built for a new batch size touches no new memory. Built per step shape, they made the first step
    of each new batch size fault in ~30 MB at 50 sequences (~8,000 page faults), and a 64-request
    workload changes batch size ~50 times."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tensors: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def of(model, batch: int) -> StepBuffers:
        """The model's buffers, anew (twice the capacity, at most MAX_BATCH) when `batch` does not fit."""
        buffers = model.__dict__.get("_step_buffers")
        if buffers is None or buffers.capacity < batch:  # plans built before keep the old tensors alive
            capacity = min(MAX_BATCH, max(batch, 2 * buffers.capacity if buffers is not None else 8))
            buffers = model.__dict__["_step_buffers"] = StepBuffers(capacity)
        return buffers

    def rows(self, name: str, batch: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [:batch] of the [capacity, width] buffer `name` (zeros when first made); width 0: the
        [batch] vector of a [capacity] buffer."""
        key = (name, width, dtype)
        if key not in self._tensors:
            self._tensors[key] = torch.zeros(self.capacity, max(width, 1), dtype=dtype)
        return self._tensors[key][:batch] if width else self._tensors[key][:batch, 0]


class DecodePlan:
    """One decode step of `batch` sequences (one new token each) of `model` over these pools."""

    # rows [:batch] of the model's StepBuffers (`_shared` names them; `_take_rows` points them)
    ids: torch.Tensor  # [B] int64 this step's tokens
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64 pool slot of each new token's K/V
    lora_slots: torch.Tensor  # [B] int64 each row's adapter (-1: none)
    tables: torch.Tensor  # [B, W] int64 block tables (its own, wider buffer after `_widen_tables`)
    x: torch.Tensor  # [B, H] the residual stream
    y: torch.Tensor  # [B, H] normed input of a block
    delta: torch.Tensor  # [B, H] a block's output, added to x by the next norm
    logits: torch.Tensor  # [B, V / tp] this rank's vocab slice

    def __init__(self, model, batch: int, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> None:
        from bestiary.core.runtime.model import torch_dtype

        self.batch = batch
        self._model = weakref.ref(model)  # the model caches its plans: a strong reference would keep it alive
        self.pool_ptrs = _pool_ptrs(k_pools) + _pool_ptrs(v_pools)
        cfg = model.config
        self.first, self.last = model.is_first_stage, model.is_last_stage  # pipeline stage (both at pp 1)
        self.dtype, hidden = model.dtype, cfg.hidden_size
        self._keep: list[torch.Tensor] = []  # tensors the records point at (biases as float32, ...)
        self._lora_ops: list[tuple[Op, Op, tuple]] = []  # (linear record, its LoRA record, modules)
        self._lora_stack = None  # the AdapterStack the LoRA records point into (kept alive while they do)
        self._reduce_ops: list[tuple[Op, torch.Tensor, torch.Tensor | None]] = []  # (row-parallel record, out, bias)
        self.tp_size, self.tp_group = model.tp_size, model.tp_group
        # per layer window (0: none): [3, B] kv lengths | windows | sinks, the attention records' sequence rows
        self.seq_rows: dict[int, torch.Tensor] = {}
        self.windows: list[tuple[torch.nn.Module, int]] = []  # (PagedAttention, its window when built)
        self.buffers = StepBuffers.of(model, batch)
        i64 = torch.int64
        # attribute -> (width, dtype) of the rows [:batch] it takes of the shared buffer of that name
        self._shared = {"ids": (0, i64), "positions": (0, i64), "slots": (0, i64),
                        "lora_slots": (0, i64),  # each row's adapter (-1: none; set every step)
                        "tables": (k_pools[0].shape[0], i64),
                        "x": (hidden, self.dtype),  # the residual stream
                        "y": (hidden, self.dtype),  # normed input of a block
                        "delta": (hidden, self.dtype),  # a block's output, added to x by the next norm
                        # this rank's vocab slice of the logits (all of them at tp 1; gathered after the plan at tp > 1)
                        "logits": (cfg.vocab_size // model.tp_size, torch_dtype(cfg.logits_dtype))}
        self._take_rows()
        self.max_position = 1 << 62  # positions the rotary tables cover
        records = []
        if self.first:
            embedding = model.transformer.vocab_embedding
            emb = embedding.weight  # a tied bf16 one in row tiles: the C embed finds its rows there
            table_dt = ops.TILED_KINDS[emb.dtype] if getattr(embedding, "_tiles", None) is not None else _dt(emb)
            records.append(_op(OP_EMBED, (table_dt, _dt(self.x)), (emb.data_ptr(), self.ids.data_ptr(),
                               self.x.data_ptr()), (batch, hidden, emb.stride(0), emb.stride(1))))
        pending = False  # a later stage starts from the hidden state it is given, in x
        for layer, k_pool, v_pool in zip(model.transformer.layers, k_pools, v_pools):
            records += self._layer(layer, k_pool, v_pool, pending)
            pending = True
        self.pending = pending  # the last layer's output still in delta (added by ln_f, or by `run`)
        if self.last:
            records.append(self._norm(model.transformer.ln_f, pending))
            records.append(self._lm_head())
        lora_after = {id(op): rec for op, rec, _ in self._lora_ops}  # each LoRA record right after its linear
        records = [r for rec in records for r in (rec, lora_after.get(id(rec))) if r is not None]
        at = {id(r): i for i, r in enumerate(records)}
        self._lora_records = [(at[id(rec)], modules) for _, rec, modules in self._lora_ops]
        # Stop points, (record index, what runs there) in record order: after a row-parallel linear at
        # tp > 1 (and its LoRA record) its partial output is all-reduced over the ranks, then its bias
        # added (Linear.forward's order)
        points = [(at[id(lora_after.get(id(op), op))] + 1, 1, functools.partial(_all_reduce, out, bias, self.tp_group))
                  for op, out, bias in self._reduce_ops]
        self.points: list[tuple[int, Callable]] = [(i, fn) for i, _, fn in sorted(points, key=lambda p: p[:2])]
        self.records = (Op * len(records))(*records)

    def _take_rows(self) -> None:
        """Point each `_shared` attribute at rows [:batch] of its StepBuffers buffer."""
        for name, (width, dtype) in self._shared.items():
            setattr(self, name, self.buffers.rows(name, self.batch, width, dtype))

    def resized(self, batch: int) -> DecodePlan | None:
        """This plan for `batch` sequences without walking the model again (~7 ms of Python per batch size
        for SmolLM2, and a 64-request workload meets ~50 sizes): the same records with each op's row count
        (BATCH_FIELD) set and the attention records pointed at new [3, batch] sequence rows; every other
        pointer is the same (the shared buffers' rows start where they did). None where only a new plan
        will do: more rows than the buffers hold, block tables widened for this plan, or tp stop points."""
        if batch > self.buffers.capacity or self.points or self.tables.shape[1] != self._shared["tables"][0]:
            return None
        plan = copy.copy(self)
        plan.batch, plan.profile, plan._lora_stack = batch, None, None
        plan._take_rows()
        plan.seq_rows = {window: torch.ones(3, batch, dtype=torch.int64) for window in self.seq_rows}
        plan.records = (Op * len(self.records))()
        ctypes.memmove(plan.records, self.records, ctypes.sizeof(self.records))
        windows = iter(window for _, window in self.windows)  # one per attention record, in order
        for record in plan.records:
            record.i[BATCH_FIELD[record.op]] = batch
            if record.op == OP_ATTENTION:
                record.p[4] = plan.seq_rows[next(windows)].data_ptr()
            if record.op == OP_LORA:
                record.p[1] = None  # no adapter until the step binds one (_bind_lora, as a new plan)
        return plan

    # --- building ------------------------------------------------------------------------
    def _norm(self, norm, add_delta: bool) -> Op:
        """y = rms_norm(x [+= delta])."""
        from bestiary.core.layers.norm import RMSNorm

        if type(norm) is not RMSNorm:
            raise Unsupported(f"norm {type(norm).__name__}")
        src, res = (self.delta, self.x) if add_delta else (self.x, None)
        return _op(OP_RMS_NORM, (_dt(self.x), _dt(norm.weight)),
                   (src.data_ptr(), _ptr(res), _ptr(res), self.y.data_ptr(), norm.weight.data_ptr()),
                   (self.batch, self.x.shape[1]), (norm.eps,))

    def _head_norm(self, qkv: torch.Tensor, norm, heads: int, offset: int) -> Op:
        """QK-norm in place: each of `heads` heads of D that start `offset` elements into each qkv row [B, width]
        becomes h / sqrt(mean(h^2) + eps) * w (w [D]), as SelfAttention's q_norm / k_norm do eagerly."""
        from bestiary.core.layers.norm import RMSNorm

        if type(norm) is not RMSNorm or norm.offset:
            raise Unsupported(f"QK-norm {type(norm).__name__} (the plan runs an RMSNorm scaled by w)")
        return _op(OP_HEAD_NORM, (_dt(qkv), _dt(norm.weight)),
                   (qkv.data_ptr() + offset * qkv.element_size(), norm.weight.data_ptr()),
                   (self.batch, heads, norm.weight.shape[0], qkv.shape[1]), (norm.eps,))

    def _linear(self, x: torch.Tensor, out: torch.Tensor, weight: ops.PackedWeight,
                bias: torch.Tensor | None) -> Op:
        """out = x W^T (+ b) through bst_linear."""
        if bias is not None:
            bias = bias.float().contiguous()
            self._keep.append(bias)
        return _op(OP_LINEAR, (_dt(x), weight.code, _dt(out)),
                   (x.data_ptr(), weight.weight.data_ptr(), _ptr(weight.scale), _ptr(weight.scale_zero), _ptr(bias),
                    out.data_ptr()),
                   (self.batch, weight.k, weight.n, weight.group))

    def _module_weight(self, linear) -> tuple[ops.PackedWeight, torch.Tensor | None]:
        """The PackedWeight (this rank's shard) and in-record bias of a shared-layer Linear (no in_perm).
        A row-parallel one at tp > 1 gets no in-record bias: `_row_parallel` adds it after the all-reduce."""
        if getattr(linear, "in_perm", None) is not None:
            raise Unsupported("permuted linear")
        if linear.quant is not None:
            packed = getattr(linear.quant, "_packed", None)
            act_quant = getattr(getattr(linear.quant, "lq", None), "act_quant", None)
            a8_kinds = (ops.KIND_I8A8, ops.KIND_I4A8)  # int8 activations quantized inside the kernel
            if act_quant is not None and not (act_quant == "int8" and packed is not None and packed.kind in a8_kinds):
                raise Unsupported(f"quantization.activation_quant on {linear.name} (the eager path quantizes inputs)")
            if packed is None:
                raise Unsupported(f"quantized linear {linear.name} without the compiled layout")
            return packed, _record_bias(linear)
        if linear._tiles is not None:
            return ops.PackedWeight.tiled(linear._tiles), _record_bias(linear)
        if linear._wt is None or not linear._wt.is_contiguous():
            raise Unsupported(f"linear {linear.name} not held transposed")
        return ops.PackedWeight.transposed(linear._wt), _record_bias(linear)

    def _row_parallel(self, op: Op, linear, out: torch.Tensor) -> Op:
        """Mark `op` (linear's partial out = x_r W_r^T at tp > 1) as a point where `out` is all-reduced."""
        if linear.tp_size > 1:
            self._reduce_ops.append((op, out, linear.bias))
        return op

    def _layer(self, layer, k_pool: torch.Tensor, v_pool: torch.Tensor, add_delta: bool) -> list[Op]:

        att, mlp = layer.attention, layer.mlp
        reason = layer_refusal(layer)
        if reason is not None:
            raise Unsupported(reason)
        kv_scales = None
        if att.attn.kv_quant is not None:  # INT8 / FP8 pools: codes with the layer's (s_k, s_v)
            kv_scales = att.attn.kv_quant.scales.float().contiguous()
            self._keep.append(kv_scales)
        b, h, kvh, d = self.batch, att.heads, att.kv_heads, att.head_dim
        width = (h + 2 * kvh) * d
        qkv = self.buffers.rows("qkv", b, width, self.dtype)
        o = self.buffers.rows("o", b, h * d, self.dtype)
        w, bias = self._module_weight(att.qkv)
        recs = [self._norm(layer.input_layernorm, add_delta), self._lora_site(self._linear(self.y, qkv, w, bias),
                                                                             (att.qkv,), self.y, qkv)]
        if att.q_norm is not None and att.k_norm is not None:  # QK-norm: the q heads, then the k heads
            recs += [self._head_norm(qkv, att.q_norm, h, 0), self._head_norm(qkv, att.k_norm, kvh, h * d)]
        if att.rotary is not None:  # a Rotary (layer_refusal)
            table = att.rotary._table(torch.device("cpu"), att.rotary.max_positions)  # [P, rot] cos | sin
            self._keep.append(table)
            self.max_position = min(self.max_position, table.shape[0] - 1)
            recs.append(_op(OP_ROTARY, (_dt(qkv),), (qkv.data_ptr(), self.positions.data_ptr(), table.data_ptr()),
                            (b, h + kvh, d, width, att.rotary.rot_dim, int(att.rotary.style == "gptj"))))
        kv_dt = _kv_dt(k_pool, kv_scales)
        item = qkv.element_size()
        recs.append(_op(OP_KV_WRITE, (_dt(qkv), kv_dt),
                        (qkv.data_ptr() + h * d * item, qkv.data_ptr() + (h + kvh) * d * item, k_pool.data_ptr(),
                         v_pool.data_ptr(), self.slots.data_ptr(), _ptr(kv_scales)),
                        (b, kvh * d, width)))
        slopes = att.attn.alibi
        if slopes is not None:
            slopes = slopes.float().contiguous()
            self._keep.append(slopes)
        rows = self.seq_rows.setdefault(att.attn.window, torch.ones(3, b, dtype=torch.int64))
        self.windows.append((att.attn, att.attn.window))
        recs.append(_op(OP_ATTENTION, (_dt(qkv), kv_dt, _dt(o)),
                        (qkv.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), self.tables.data_ptr(),
                         rows.data_ptr(), _ptr(slopes), o.data_ptr(), _ptr(kv_scales)),
                        (self.tables.shape[1], b, h, kvh, d, k_pool.shape[1], 1, width), (att.attn.scale,)))
        w, bias = self._module_weight(att.dense)
        recs.append(self._row_parallel(self._lora_site(self._linear(o, self.delta, w, bias), (att.dense,), o,
                                                       self.delta), att.dense, self.delta))
        recs.append(self._norm(layer.post_layernorm, True))
        recs += self._mlp(mlp)
        return recs

    def _mlp(self, mlp) -> list[Op]:
        fused_q = mlp.__dict__.get("_fused_q")
        if fused_q is not None:
            w, bias = self._module_weight(fused_q)
        elif mlp._fused_tiles is not None:
            w, bias = ops.PackedWeight.tiled(mlp._fused_tiles), mlp._fused_bias
        elif mlp._fused_t is not None:
            w, bias = ops.PackedWeight.transposed(mlp._fused_t), mlp._fused_bias
        else:
            raise Unsupported("gated MLP without a fused fc + gate")
        inter = w.n // 2
        fg = self.buffers.rows("fc_gate", self.batch, 2 * inter, self.dtype)
        m = self.buffers.rows("act", self.batch, inter, self.dtype)
        pw, pbias = self._module_weight(mlp.proj)
        return [self._lora_site(self._linear(self.y, fg, w, bias), (mlp.fc, mlp.gate), self.y, fg),
                _op(OP_ACT_MUL, (_dt(fg),), (fg.data_ptr(), m.data_ptr()), (self.batch, inter, ACT_CODES[mlp.act_name])),
                self._row_parallel(self._lora_site(self._linear(m, self.delta, pw, pbias), (mlp.proj,), m, self.delta),
                                   mlp.proj, self.delta)]

    def _lora_site(self, op: Op, modules: tuple, x: torch.Tensor, out: torch.Tensor) -> Op:
        """Give `op` (out = x W^T of `modules`' outputs side by side) a LoRA record, out += each row's
        adapter's update on x; it points at no adapter weights (adds nothing) until a step binds them."""
        pointers = (x.data_ptr(), None, None, None, None, self.lora_slots.data_ptr(), out.data_ptr())
        lora = _op(OP_LORA, (_dt(x), 0, _dt(out)), pointers, (self.batch, x.shape[1], 0, out.shape[1]))
        self._lora_ops.append((op, lora, modules))
        return op

    def _bind_lora(self, lora) -> None:
        """The step's LoRA (a StepLora, or None): each row's adapter into lora_slots, and the LoRA records
        pointed at its stack's Site.rows (only when the stack is not the one they point at)."""
        if lora is None:
            self.lora_slots.fill_(-1)
            return
        if lora.stack is not self._lora_stack:
            for index, modules in self._lora_records:
                site = lora.stack.site_of(modules)
                rows, record = (site.rows if site is not None else None), self.records[index]
                record.p[1] = None if rows is None else rows.a.data_ptr()  # NULL: nothing to add
                if rows is not None:
                    for j, t in ((2, rows.b), (3, rows.scale), (4, rows.layout)):
                        record.p[j] = t.data_ptr()
                    record.dt[1], record.i[2] = _dt(rows.a), rows.adapters
            self._lora_stack = lora.stack
        self.lora_slots.copy_(lora.token_slot)

    @property
    def model(self):
        """The model this plan runs (held weakly: the model holds its plans, and a cycle would keep an engine's
        weights alive after its LLM is dropped until the cycle collector runs)."""
        model = self._model()
        assert model is not None, "a decode plan outlived its model"
        return model

    def _lm_head(self) -> Op:
        model = self.model
        if model._lm_head_tiles is not None:
            return self._linear(self.y, self.logits, ops.PackedWeight.tiled(model._lm_head_tiles), None)
        if model._lm_head_t is not None:
            return self._linear(self.y, self.logits, ops.PackedWeight.transposed(model._lm_head_t), None)
        if model.shares_embedding:
            raise Unsupported("tied lm_head not held transposed")
        w, bias = self._module_weight(model.lm_head)
        return self._linear(self.y, self.logits, w, bias)

    # --- running -------------------------------------------------------------------------
    def same_pools(self, k_pools, v_pools) -> bool:
        """True when the plan was built over these pools: lists of per-layer pools, or stacked [L, ...]
        tensors (the layers' pointers computed from the stack's: iterating it makes L views, ~50 us a
        step)."""
        return _pool_ptrs(k_pools) + _pool_ptrs(v_pools) == self.pool_ptrs

    def fits(self, meta) -> bool:
        """True when this plan can run the decode step `meta` (its batch, lengths and positions; the layers
        still have the attention windows the plan was built with)."""
        from bestiary.core.lora.batch import StepLora

        lora = meta.lora
        return (len(meta.seq_lens) == self.batch and all(a.window == w for a, w in self.windows)
                and max(meta.context_lens) <= self.max_position
                and (lora is None or (isinstance(lora, StepLora) and lora.token_slot.shape == (self.batch,)
                                      and lora.stack.device.type == "cpu")))

    def _widen_tables(self, width: int) -> None:
        """Block tables wider than the pool has blocks (a sequence whose early blocks were released out
        of an attention window, core.runtime.kv_window): a buffer twice as wide, pointed at by every
        attention record."""
        self.tables = torch.zeros(self.batch, max(width, 2 * self.tables.shape[1]), dtype=torch.int64)  # its own
        for record in self.records:
            if record.op == OP_ATTENTION:
                record.p[3], record.i[0] = self.tables.data_ptr(), self.tables.shape[1]

    profile: torch.Tensor | None = None  # float64 [records]: seconds spent in each record (start_profile)

    def start_profile(self) -> None:
        """Time every record from now on (one compiled call per record: a little slower), adding to
        `profile`; `profile_rows` reads it."""
        self.profile = torch.zeros(len(self.records), dtype=torch.float64)

    def profile_rows(self) -> list[tuple[str, float]]:
        """(label, seconds) of every record since start_profile, in order: the op, and for a linear its
        K x N and weight kind (e.g. "linear 576x1728 bf16")."""
        names = ["embed", "rms_norm", "linear", "rotary", "kv_write", "attention", "act_mul", "lora"]
        kinds = {ops.KIND_F32: "fp32", ops.KIND_F32T: "fp32", ops.KIND_BF16: "bf16", ops.KIND_BF16T: "bf16",
                 ops.KIND_I8: "int8", ops.KIND_I8T: "int8", ops.KIND_I4: "int4", ops.KIND_I4D: "int4", ops.KIND_I4Q: "int4",
                 ops.KIND_I8A8: "int8xint8", ops.KIND_I4A8: "int4xint8"}
        if self.profile is None:
            raise RuntimeError("profile_rows before start_profile")
        rows = []
        for record, seconds in zip(self.records, self.profile.tolist()):
            label = names[record.op]
            if record.op == OP_LINEAR:  # i: batch, K, N, group; dt[1]: the weight-kind code (PackedWeight.code)
                label = f"linear {record.i[1]}x{record.i[2]} {kinds.get(record.dt[1] & ~ops.SCALES_BF16, '?')}"
            rows.append((label, seconds))
        return rows

    def _run(self, start: int, end: int, threads: int) -> None:
        """Records start .. end - 1 in one compiled call (one per record, timed, while profiling)."""
        if end <= start:
            return
        first = ctypes.addressof(self.records) + start * ctypes.sizeof(Op)
        lib = library()
        if lib is None:  # plan_for builds plans only while it loads; turned off since (BESTIARY_CPU_KERNELS)
            raise RuntimeError("a decode plan ran without the CPU kernel library")
        if self.profile is None:
            lib.bst_run_plan(first, end - start, threads)
        else:
            lib.bst_run_plan_timed(first, end - start, threads, self.profile[start:end].data_ptr())

    def run(self, ids: torch.Tensor, meta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B] (one new token per sequence) -> logits [B, V] (a fresh tensor). A pipeline stage after
        the first starts from `hidden` [B, H] (the previous stage's output); a stage before the last
        returns its hidden state [B, H] (x + the last layer's output) instead of logits."""
        self.ids.copy_(ids)
        if not self.first:
            if hidden is None:
                raise ValueError("a pipeline stage after the first runs from the previous stage's hidden state")
            self.x.copy_(hidden)
        self.positions.copy_(meta.positions)
        kv_lens = torch.tensor(meta.kv_lens)
        for window, rows in self.seq_rows.items():  # each layer window's kv lengths, windows and sinks
            bounds = meta.window_bounds(window)
            rows[0].copy_(kv_lens)
            rows[1:].copy_(torch.tensor(bounds) if bounds is not None else torch.zeros(2, self.batch, dtype=torch.int64))
        self.slots.copy_(meta.slot_mapping)
        if meta.block_tables.shape[1] > self.tables.shape[1]:
            self._widen_tables(meta.block_tables.shape[1])
        self.tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._bind_lora(meta.lora)
        start, threads = 0, torch.get_num_threads()
        for end, point in self.points:  # (tp > 1) run up to each stop point, do its torch work, go on
            if point(meta):
                self._run(start, end, threads)
                point(meta, run=True)
                start = end
        self._run(start, len(self.records), threads)
        self.model.__dict__["plan_steps"] = self.model.__dict__.get("plan_steps", 0) + 1  # tests: the plan ran
        if not self.last:
            return self.x + self.delta if self.pending else self.x.clone()  # the residual stream after the layers
        if self.tp_size == 1:
            return self.logits.clone()
        parts = [torch.empty_like(self.logits) for _ in range(self.tp_size)]  # [B, V/tp] each
        torch.distributed.all_gather(parts, self.logits, group=self.tp_group)
        return torch.cat(parts, dim=-1)  # [B, V], the eager DecoderLM.logits gather


def _pool_ptrs(pools) -> list[int]:
    """The data pointer of each layer's pool: pools a list of tensors or one stacked [L, ...] tensor."""
    if isinstance(pools, torch.Tensor):
        base, step = pools.data_ptr(), pools.stride(0) * pools.element_size()
        return [base + i * step for i in range(pools.shape[0])]
    return [p.data_ptr() for p in pools]


def _record_bias(linear) -> torch.Tensor | None:
    """The bias a linear record adds: none for a row-parallel linear at tp > 1 (added after the all-reduce)."""
    from bestiary.core.layers.linear import Parallel

    return None if linear.tp_size > 1 and linear.parallel == Parallel.ROW else linear.bias


def _all_reduce(out: torch.Tensor, bias: torch.Tensor | None, group, meta, run: bool = False) -> bool:
    """Row-parallel stop point (always taken): out = sum over tp ranks (the stage's `group`) of out (+ bias, once)."""
    if run:
        torch.distributed.all_reduce(out, group=group)
        if bias is not None:
            out += bias
    return True


# What a plan's layer is, and what the other layouts of core.layers.builder are called in a refusal.
LAYOUTS = {"PostNormDecoderLayer": "post-norm layout", "ParallelDecoderLayer": "parallel attention + MLP layout",
           "ScaledResidualLayer": "scaled-residual layout", "OutputNormDecoderLayer": "output-norm layout",
           "SandwichNormDecoderLayer": "sandwich-norm layout (norms before and after each sublayer)"}


def layer_refusal(layer) -> str | None:
    """What in `layer` a plan cannot run (the plan runs pre-norm RMSNorm layers of SelfAttention with
    PagedAttention and neox / gptj rotary or none, and a gated MLP of a compiled activation), or None."""
    from bestiary.core.layers.attention import PagedAttention
    from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
    from bestiary.core.layers.mlp import GatedMLP
    from bestiary.core.layers.norm import RMSNorm
    from bestiary.core.layers.rotary import Rotary
    from bestiary.core.layers.self_attention import SelfAttention

    kind = type(layer).__name__
    if type(layer) is not PreNormDecoderLayer:
        return f"the {LAYOUTS.get(kind, kind)} ({kind}; the plan runs pre-norm layers)"
    att, mlp = layer.attention, layer.mlp
    norms = {type(layer.input_layernorm).__name__, type(layer.post_layernorm).__name__} - {RMSNorm.__name__}
    if norms:
        return f"{' and '.join(sorted(norms))} norms (the plan runs RMSNorm)"
    if type(att) is not SelfAttention:
        return f"attention {type(att).__name__} (the plan runs SelfAttention)"
    if getattr(att.attn, "sink_logits", None) is not None:
        return "attention sink logits (a learned logit per head in the softmax; the plan's attention has none)"
    if type(mlp) is not GatedMLP:
        return f"{type(mlp).__name__} feed-forward block (the plan runs a gated MLP: proj(act(fc x) * gate x))"
    if att.attn.softcap is not None:
        return "an attention logit soft-cap (the plan's attention has none)"
    if att.attn.key_bias is not None:
        return "a key bias function in attention (ALiBi slopes run; a bias table does not)"
    if type(att.attn).forward is not PagedAttention.forward:  # e.g. Qwen-1's logn query scaling
        return f"attention op {type(att.attn).__name__} (its own forward)"
    if att.q_norm is not None and type(att.q_norm) is not RMSNorm:
        return f"QK-norm {type(att.q_norm).__name__} (the plan runs an RMSNorm over each head)"
    if att.head_dim > ops.MAX_HEAD_DIM:
        return f"head_dim {att.head_dim} > {ops.MAX_HEAD_DIM}"
    if mlp.act_name not in ACT_CODES:
        return f"activation {mlp.act_name} (compiled: {', '.join(sorted(ACT_CODES))})"
    if att.rotary is not None and type(att.rotary) is not Rotary:
        return f"rotary {type(att.rotary).__name__}"
    return None


PLAIN_TOP_LEVEL = {"vocab_embedding", "layers", "ln_f"}  # transformer.* modules a plan runs


def refusal(model, placed: bool = True) -> str | None:
    """Why no plan can run `model` at all (before looking at its layers), or None. `placed` False: a
    model on the meta device (`bestiary inspect`), whose placement and hooks are not asked about.

    An architecture that overrides `embed`, `logits` or `position_ids`, or has top-level modules
    besides the token embedding, the layers and ln_f (DecoderLM.make_top_level_modules) or an
    embedding_scale, runs eagerly; `DecoderLM.decode_plan_status()` reports the reason.
    """
    from bestiary.core.runtime.model import DecoderLM

    cls = type(model)
    embedding = getattr(model.transformer, "vocab_embedding", None)  # None: a later pipeline stage
    if model.tp_size != 1 and getattr(embedding, "sharding_dim", None) is not None:
        return "parallel embedding (use_parallel_embedding) at tp > 1"
    overridden = [n for n in ("embed", "logits", "position_ids") if getattr(cls, n) is not getattr(DecoderLM, n)]
    if overridden:
        return f"{cls.__name__} overrides {', '.join(overridden)}"
    extra = sorted(set(dict(model.transformer.named_children())) - PLAIN_TOP_LEVEL)
    if extra:
        return f"top-level modules {', '.join(extra)}"
    if model.embedding_scale is not None:
        return f"an embedding scale (x = embedding * {model.embedding_scale:g}; the plan's embedding has none)"
    if model.logit_softcap is not None:
        return "a final-logit soft-cap (the plan's lm_head has none)"
    if any(getattr(m, "offset", 0.0) for m in model.modules() if type(m).__name__ == "RMSNorm"):
        return "RMSNorm with a (offset + w) scale (the plan's norm multiplies by w)"
    if placed and next(model.parameters()).device.type != "cpu":
        return "weights not on the CPU"
    if placed and any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks (a plan runs no module: hooks would be skipped)"
    for i, layer in enumerate(model.transformer.layers):
        reason = layer_refusal(layer)
        if reason is not None:
            return f"layer {model.layer_offset + i}: {reason}"
    return None


def plan_for(model, batch: int, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor],
             like: DecodePlan | None = None) -> DecodePlan | None:
    """A DecodePlan for `model` (`like` resized, when it is a plan of the model over these pools that can
    be), or None when the compiled kernels are off or the model has something a plan does not express
    (then the eager path runs every step; the reason is kept in `model.decode_plan_refusal`)."""
    from bestiary.core.kernels import dispatch

    if not 1 <= batch <= MAX_BATCH or dispatch.mode() != "auto" or library() is None:
        return None
    reason = refusal(model)
    if reason is None:
        if like is not None and like.model is model and like.same_pools(k_pools, v_pools):
            resized = like.resized(batch)
            if resized is not None:
                return resized
        try:
            return DecodePlan(model, batch, k_pools, v_pools)
        except Unsupported as err:
            reason = str(err)
    model.__dict__["decode_plan_refusal"] = reason
    return None
