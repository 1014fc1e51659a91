"""Each Triton kernel of core/kernels against its torch reference, on a CUDA device.

    python benchmarks/kernels.py [--dtype bfloat16] [--tokens 1,16,64] [--ops norms,attention,...] [--rep 100]

Shapes are LLaMA-7B-like (hidden 4096, 32 heads of 128, FFN 11008), with 1..64 tokens
per step: norms, rotary, gated activations, paged decode over 2k cached tokens (MHA and
GQA 32/8, plus ALiBi), packed causal prefill, Mixtral-like MoE (8 experts, top-2,
FFN 14336), weight-only GEMMs (int8 per channel, int4 group 128 with zero points and 64
without, plus cuBLAS on the dense weight for scale), batched LoRA (4 adapters, ranks
8..64) and top-k/top-p filtering over a 32000 vocab.

Times are medians of triton.testing.do_bench (it flushes L2 between runs). For each row:

    GB/s     = bytes / time      bytes: the least a kernel must move (weights, KV, in + out)
    TFLOP/s  = flops / time      flops: 2 per multiply-add of the op's matmuls
    % peak   = max(GB/s / peak GB/s, TFLOP/s / peak TFLOP/s), the bound it is nearest to

taken from the Triton time (the torch time where a row has no kernel). The device peak
comes from PEAKS by device name (HBM bandwidth; dense bf16/fp16 tensor-core TFLOP/s), or
is "unknown". On a machine without CUDA the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bestiary.core.kernels.dispatch import FAMILIES

NEEDS_CUDA = "benchmarks/kernels.py needs a CUDA device (torch.cuda.is_available() is False): nothing timed."
HIDDEN, HEADS, HEAD_DIM, FFN = 4096, 32, 128, 11008
GQA_KV_HEADS, CONTEXT, BLOCK_SIZE = 8, 2048, 16
PREFILL_SEQS, PREFILL_LEN, CHUNK_LEN, CHUNK_CONTEXT = 4, 512, 256, 1024
ROPE_POSITIONS = 4096
MOE_EXPERTS, MOE_TOP_K, MOE_FFN = 8, 2, 14336
LORA_RANKS, LORA_SEGMENT = (8, 16, 32, 64), 128
VOCAB = 32000
DEVICE = "cuda"  # the tests point it (and shrink the shapes above) at the CPU interpreter


@dataclass(frozen=True)
class Peak:
    """A GPU's data-sheet peaks: HBM bandwidth and dense bf16/fp16 tensor-core throughput."""

    label: str
    gbps: float
    tflops: float


# First pattern (case-insensitive regex on torch.cuda.get_device_name) that matches wins.
PEAKS: list[tuple[str, Peak]] = [
    (r"H200", Peak("H200", 4800, 989)),
    (r"H100.*NVL", Peak("H100 NVL", 3900, 835)),
    (r"H100.*PCIe", Peak("H100 PCIe", 2000, 756)),
    (r"H100", Peak("H100 SXM", 3350, 989)),
    (r"A100.*40GB", Peak("A100 40GB", 1555, 312)),
    (r"A100.*PCIe", Peak("A100 PCIe 80GB", 1935, 312)),
    (r"A100", Peak("A100 SXM 80GB", 2039, 312)),
    (r"L40S", Peak("L40S", 864, 362)),
    (r"\bL4\b", Peak("L4", 300, 121)),
]


def device_peak(name: str) -> Peak | None:
    """The peak of the GPU called `name`, or None when it is not in PEAKS."""
    for pattern, peak in PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return peak
    return None


@dataclass
class Case:
    """One row: the kernel and its reference as no-argument calls, and the work they do."""

    op: str
    shape: str
    triton: Callable[[], object] | None
    torch: Callable[[], object]
    bytes: float
    flops: float = 0.0


@dataclass
class Timing:
    """A timed row; it keeps no tensors (the case's inputs are freed once it is timed)."""

    op: str
    shape: str
    bytes: float
    flops: float
    triton_ms: float | None
    torch_ms: float


# --- cases ---------------------------------------------------------------------------------


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).mul_(scale).to(dtype)


def norm_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m, es = family("norms"), dtype.itemsize
    w, b = _randn(HIDDEN, dtype=dtype), _randn(HIDDEN, dtype=dtype)
    cases = []
    for t in tokens:
        x, r = _randn(t, HIDDEN, dtype=dtype), _randn(t, HIDDEN, dtype=dtype)
        shape, io2, io4 = f"[{t}, {HIDDEN}]", (2 * t + 1) * HIDDEN * es, (4 * t + 1) * HIDDEN * es
        cases += [
            Case("rms_norm", shape, lambda x=x: m.rms_norm(x, w, 1e-6), lambda x=x: m.rms_norm_ref(x, w, 1e-6), io2),
            Case("layer_norm +bias", shape, lambda x=x: m.layer_norm(x, w, b, 1e-5),
                 lambda x=x: m.layer_norm_ref(x, w, b, 1e-5), io2 + HIDDEN * es),
            Case("add + rms_norm", shape, lambda x=x, r=r: m.add_rms_norm(x, r, w, 1e-6),
                 lambda x=x, r=r: m.add_rms_norm_ref(x, r, w, 1e-6), io4),
        ]
    return cases


def rotary_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m, es = family("rotary"), dtype.itemsize
    half = HEAD_DIM // 2
    table = torch.randn(ROPE_POSITIONS, HEAD_DIM, device=DEVICE)  # [P, rot_dim] = [cos | sin], float32
    cases = []
    for t in tokens:
        x = _randn(t, HEADS, HEAD_DIM, dtype=dtype)
        cos, sin = _randn(t, 1, half, dtype=dtype), _randn(t, 1, half, dtype=dtype)
        pos = torch.randint(0, ROPE_POSITIONS, (t,), device=DEVICE)
        shape, io = f"[{t}, {HEADS}, {HEAD_DIM}]", 2 * t * HEADS * HEAD_DIM * es
        cases += [
            Case("rotary neox", shape, lambda x=x, c=cos, s=sin: m.apply_rotary(x, c, s, HEAD_DIM, "neox"),
                 lambda x=x, c=cos, s=sin: m.apply_rotary_ref(x, c, s, HEAD_DIM, "neox"), io + 2 * t * half * es),
            Case("rotary gptj, positions", shape, lambda x=x, p=pos: m.rotary_embedding(x, p, table, HEAD_DIM, "gptj"),
                 lambda x=x, p=pos: m.rotary_embedding_ref(x, p, table, HEAD_DIM, "gptj"), io + t * (HEAD_DIM * 4 + 8)),
        ]
    return cases


def activation_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m, es = family("activations"), dtype.itemsize
    cases = []
    for t in tokens:
        f, g = _randn(t, 2 * FFN, dtype=dtype).chunk(2, dim=-1)  # the halves of a fused gate/up output
        for act in ("silu", "gelu_new"):
            cases.append(Case(f"{act}_and_mul", f"[{t}, {FFN}]", lambda f=f, g=g, a=act: m.act_and_mul(f, g, a),
                              lambda f=f, g=g, a=act: m.act_and_mul_ref(f, g, a), 3 * t * FFN * es))
    return cases


def _paged(b: int, seq: int, ctx: int, kvh: int, dtype: torch.dtype):
    """(q, k, v, meta, k_pool, v_pool) for b sequences of `seq` new tokens after `ctx` cached, shuffled blocks."""
    from bestiary.core.kernels.attention_ref import write_kv
    from bestiary.core.kernels.metadata import AttentionMetadata

    per_seq = -(-(ctx + seq) // BLOCK_SIZE)
    order = torch.randperm(b * per_seq).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(b)]
    meta = AttentionMetadata.build([seq] * b, [ctx] * b, tables, BLOCK_SIZE, device=DEVICE)
    k_pool = _randn(b * per_seq, BLOCK_SIZE, kvh, HEAD_DIM, dtype=dtype)
    v_pool = _randn(b * per_seq, BLOCK_SIZE, kvh, HEAD_DIM, dtype=dtype)
    q = _randn(b * seq, HEADS, HEAD_DIM, dtype=dtype)
    k, v = _randn(b * seq, kvh, HEAD_DIM, dtype=dtype), _randn(b * seq, kvh, HEAD_DIM, dtype=dtype)
    write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
    return q, k, v, meta, k_pool, v_pool


def _attention_case(m, op: str, b: int, seq: int, ctx: int, kvh: int, dtype: torch.dtype, alibi: bool) -> Case:
    from bestiary.core.layers.attention import alibi_slopes

    q, k, v, meta, kp, vp = _paged(b, seq, ctx, kvh, dtype)
    slopes = alibi_slopes(HEADS).to(DEVICE) if alibi else None
    scale, es = HEAD_DIM**-0.5, dtype.itemsize
    kv_len = ctx + seq
    pairs = b * (seq * ctx + seq * (seq + 1) / 2)  # visible (query, key) pairs, causal
    io = 2 * b * kv_len * kvh * HEAD_DIM * es + 2 * b * seq * HEADS * HEAD_DIM * es
    shape = f"{b} seq x {seq} new, ctx {ctx}, h{HEADS}/kv{kvh}"
    return Case(op, shape, lambda: m.paged_attention(q, k, v, meta, kp, vp, scale, slopes),
                lambda: m.paged_attention_ref(q, k, v, meta, kp, vp, scale, slopes), io, 4 * pairs * HEADS * HEAD_DIM)


def attention_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m = family("attention")
    cases = []
    for b in tokens:
        for kvh in (HEADS, GQA_KV_HEADS):
            cases.append(_attention_case(m, "paged decode", b, 1, CONTEXT, kvh, dtype, False))
    cases.append(_attention_case(m, "paged decode alibi", max(tokens), 1, CONTEXT, HEADS, dtype, True))
    for kvh in (HEADS, GQA_KV_HEADS):
        cases.append(_attention_case(m, "prefill causal", PREFILL_SEQS, PREFILL_LEN, 0, kvh, dtype, False))
    cases.append(_attention_case(m, "prefill chunk after context", PREFILL_SEQS, CHUNK_LEN, CHUNK_CONTEXT,
                                 GQA_KV_HEADS, dtype, False))
    return cases


def moe_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m, es = family("moe"), dtype.itemsize
    h, i, e, k = HIDDEN, MOE_FFN, MOE_EXPERTS, MOE_TOP_K
    w_fc, w_gate = _randn(e, i, h, dtype=dtype, scale=h**-0.5), _randn(e, i, h, dtype=dtype, scale=h**-0.5)
    w_proj = _randn(e, h, i, dtype=dtype, scale=i**-0.5)
    cases = []
    for t in tokens:
        x, logits = _randn(t, h, dtype=dtype), _randn(t, e, dtype=dtype)
        weights, experts = m.moe_route_ref(logits, k)
        touched = experts.unique().numel()
        io = touched * 3 * i * h * es + 2 * t * h * es
        cases += [
            Case("moe route softmax top-2", f"[{t}, {e}]", lambda lg=logits: m.moe_route(lg, k),
                 lambda lg=logits: m.moe_route_ref(lg, k), t * e * es + t * k * 12),
            Case("fused moe (silu gated)", f"[{t}, {h}] E{e} top{k} I{i}, {touched} hit",
                 lambda x=x, w=weights, ex=experts: m.fused_moe(x, w_fc, w_gate, w_proj, w, ex, "silu"),
                 lambda x=x, w=weights, ex=experts: m.fused_moe_ref(x, w_fc, w_gate, w_proj, w, ex, "silu"),
                 io, 2 * t * k * 3 * h * i),
        ]
    return cases


def woq_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m, es = family("woq_gemm"), dtype.itemsize
    n, k = FFN, HIDDEN
    dense = _randn(n, k, dtype=dtype, scale=k**-0.5)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=DEVICE)
    s8 = _randn(n, dtype=dtype).abs_().mul_(1e-3)
    q4 = m.pack_int4(torch.randint(0, 16, (n, k), device=DEVICE))
    s128 = _randn(n, k // 128, dtype=dtype).abs_().mul_(1e-2)
    z128 = torch.randint(0, 16, (n, k // 128), device=DEVICE).to(dtype)
    s64 = _randn(n, k // 64, dtype=dtype).abs_().mul_(1e-2)
    cases = []
    for t in tokens:
        x = _randn(t, k, dtype=dtype)
        shape, act_io, flops = f"[{t}, {k}] x [{n}, {k}]^T", (t * k + t * n) * es, 2 * t * n * k
        cases += [
            Case("linear dense (cuBLAS, no kernel)", shape, None, lambda x=x: torch.nn.functional.linear(x, dense),
                 n * k * es + act_io, flops),
            Case("woq int8 per-channel", shape, lambda x=x: m.woq_int8_linear(x, q8, s8),
                 lambda x=x: m.woq_int8_linear_ref(x, q8, s8), n * k + n * es + act_io, flops),
            Case("woq int4 g128 + zeros", shape, lambda x=x: m.woq_int4_linear(x, q4, s128, z128, 128),
                 lambda x=x: m.woq_int4_linear_ref(x, q4, s128, z128, 128),
                 n * k / 2 + 2 * s128.numel() * es + act_io, flops),
            Case("woq int4 g64 symmetric", shape, lambda x=x: m.woq_int4_linear(x, q4, s64, None, 64),
                 lambda x=x: m.woq_int4_linear_ref(x, q4, s64, None, 64), n * k / 2 + s64.numel() * es + act_io, flops),
        ]
    return cases


def _lora_case(m, seg_lens: list[int], dtype: torch.dtype, a, b, ranks: list[int], scalings) -> Case:
    es, k, n = dtype.itemsize, a.shape[2], b.shape[1]
    adapters = [s % len(ranks) for s in range(len(seg_lens))]
    starts = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seg_adapters = torch.tensor(adapters, dtype=torch.int32, device=DEVICE)
    rank_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    x = _randn(sum(seg_lens), k, dtype=dtype)
    io = sum(ranks[a_] * (k + n) for a_ in set(adapters)) * es + x.shape[0] * (k + n) * es
    flops = sum(2 * t * ranks[a_] * (k + n) for t, a_ in zip(seg_lens, adapters))
    shape = f"{len(seg_lens)} seg x {seg_lens[0]} tok, [{k}]->[{n}], ranks {'/'.join(map(str, ranks))}"
    return Case("lora sgmv" if seg_lens[0] > 1 else "lora bgmv (decode)", shape,
                lambda: m.lora_sgmv(x, a, b, starts, seg_adapters, rank_t, scalings),
                lambda: m.lora_sgmv_ref(x, a, b, starts, seg_adapters, rank_t, scalings), io, flops)


def lora_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m = family("lora")
    ranks = list(LORA_RANKS)
    a = _randn(len(ranks), max(ranks), HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    b = _randn(len(ranks), HIDDEN, max(ranks), dtype=dtype, scale=0.1)
    scalings = torch.tensor([2.0**-i for i in range(len(ranks))], device=DEVICE)
    cases = [_lora_case(m, [1] * t, dtype, a, b, ranks, scalings) for t in tokens]
    cases.append(_lora_case(m, [LORA_SEGMENT] * PREFILL_SEQS, dtype, a, b, ranks, scalings))
    return cases


def sampling_cases(dtype: torch.dtype, tokens: list[int], family) -> list[Case]:
    m = family("sampling")
    cases = []
    for t in tokens:
        logits = torch.randn(t, VOCAB, device=DEVICE) * 4
        top_k = torch.full((t,), 50, device=DEVICE)
        top_p = torch.full((t,), 0.9, device=DEVICE)
        cases.append(Case("top-k 50 / top-p 0.9", f"[{t}, {VOCAB}] fp32",
                          lambda lg=logits, k=top_k, p=top_p: m.filter_logits(lg, k, p),
                          lambda lg=logits, k=top_k, p=top_p: m.filter_logits_ref(lg, k, p), 2 * t * VOCAB * 4))
    return cases


BUILDERS = {
    "norms": norm_cases, "rotary": rotary_cases, "activations": activation_cases, "attention": attention_cases,
    "moe": moe_cases, "woq_gemm": woq_cases, "lora": lora_cases, "sampling": sampling_cases,
}


# --- timing and the table ------------------------------------------------------------------


def time_ms(fn: Callable[[], object], rep: int) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench: warm-up, L2 flushed per run)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(rep // 4, 5), rep=rep, return_mode="median"))


def run_case(case: Case, rep: int) -> Timing:
    triton_ms = time_ms(case.triton, rep) if case.triton else None
    return Timing(case.op, case.shape, case.bytes, case.flops, triton_ms, time_ms(case.torch, rep))


def _fmt_us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:,.1f}"


def row(t: Timing, peak: Peak | None) -> list[str]:
    """Table cells for one timing: op, shape, times, speedup, GB/s, TFLOP/s, % of peak."""
    ms = t.triton_ms if t.triton_ms is not None else t.torch_ms
    gbps, tflops = t.bytes / ms / 1e6, t.flops / ms / 1e9
    speed = "-" if t.triton_ms is None else f"{t.torch_ms / t.triton_ms:.2f}x"
    if peak is None:
        pct = "unknown"
    else:
        mem, flop = gbps / peak.gbps, tflops / peak.tflops
        pct = f"{100 * max(mem, flop):.0f}% {'mem' if mem >= flop else 'flop'}"
    return [t.op, t.shape, _fmt_us(t.triton_ms), _fmt_us(t.torch_ms), speed, f"{gbps:,.0f}",
            f"{tflops:,.1f}" if t.flops else "-", pct]


def peak_line(name: str, peak: Peak | None) -> str:
    if peak is None:
        return f"{name}: peak unknown (not in the PEAKS table of benchmarks/kernels.py)"
    return f"{name} = {peak.label}: peak {peak.gbps:,.0f} GB/s HBM, {peak.tflops:,.0f} TFLOP/s dense bf16/fp16"


def print_table(timings: list[Timing], name: str, peak: Peak | None, dtype: torch.dtype) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Triton kernels vs torch references, {dtype} ({peak_line(name, peak)})")
    for col in ("op", "shape", "triton µs", "torch µs", "speedup", "GB/s", "TFLOP/s", "% peak"):
        table.add_column(col, justify="left" if col in ("op", "shape") else "right")
    for t in timings:
        table.add_row(*row(t, peak))
    Console(width=200).print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", default="1,16,64", help="tokens (decode: sequences) per step, comma-separated")
    p.add_argument("--ops", default=",".join(FAMILIES), help=f"kernel families, comma-separated: {','.join(FAMILIES)}")
    p.add_argument("--rep", type=int, default=100, help="milliseconds of timed runs per measurement")
    args = p.parse_args(argv)
    unknown = sorted(set(args.ops.split(",")) - set(FAMILIES))
    if unknown:
        p.error(f"--ops {','.join(unknown)}: expected some of {','.join(FAMILIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 0
    from bestiary.core.kernels import dispatch

    dtype = getattr(torch, args.dtype)
    tokens = [int(t) for t in args.tokens.split(",")]
    name = torch.cuda.get_device_name()
    torch.manual_seed(0)
    timings = []
    for fam in args.ops.split(","):
        cases = BUILDERS[fam](dtype, tokens, dispatch.family)
        for case in cases:
            timings.append(run_case(case, args.rep))
            print(f"  {case.op:34s} {case.shape:48s} done", file=sys.stderr, flush=True)
        del cases, case  # the family's tensors
        torch.cuda.empty_cache()
    print_table(timings, name, device_peak(name), dtype)
    geo = [t.torch_ms / t.triton_ms for t in timings if t.triton_ms]
    if geo:
        print(f"geometric-mean speedup of Triton over torch: {math.exp(sum(map(math.log, geo)) / len(geo)):.2f}x "
              f"over {len(geo)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
