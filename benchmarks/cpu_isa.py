"""Batch-1 decode tokens/s per mode with each CPU kernel build (AVX-512, AVX2, ...) and llama.cpp, same run.

SmolLM2-135M-Instruct from the demo GGUF, per mode (fp32; bf16; W8A16 and W4A16 with bf16
activations, round-to-nearest weights): one engine, then --repeats rounds; each round measures
every ISA build this CPU runs (BESTIARY_CPU_ISA forced in-process, core.kernels.cpu.build.library
re-chosen) and llama.cpp on the GGUF (if llama-cpp-python is importable), in an order that
rotates each round. Decode speed as benchmarks/quant.py measures it: (time for 1 + N tokens -
time for 1) / N, greedy, EOS ignored; medians per cell, and each ISA's ratio to the first
(the best this CPU runs) and to llama.cpp. Prints the CPU's flags and the load average: the
machine may be shared.

    python benchmarks/cpu_isa.py [--new_tokens 64] [--repeats 5] [--modes fp32 bf16 W8A16 W4A16]
                                 [--isas avx512 avx2]

--ops times the compiled ops alone instead, on SmolLM2's decode shapes (GEMV of one token
through the fused qkv, o, gate|up, down projections and the 49152-row lm_head per weight kind,
decode attention over 256 keys, rms_norm, silu-and-mul, rotary, INT8 KV write): the best of
--repeats rounds per ISA, rounds interleaved. The best-of is the estimate least hurt by other
processes on a shared machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import tempfile
from pathlib import Path

import torch
from quant import PROMPT, decode_rate, llama_cpp_seconds, ours_seconds

LLAMA_CPP = "llama.cpp"


def mode_settings() -> dict:
    """Mode -> (dtype, quantization section or None)."""
    from bestiary.core.format.config import QuantConfig

    return {"fp32": ("float32", None), "bf16": ("bfloat16", None),
            "W8A16": ("bfloat16", QuantConfig(quant_algo="W8A16")),
            "W4A16": ("bfloat16", QuantConfig(quant_algo="W4A16"))}


def use_isa(isa: str, model=None) -> None:
    """Force the kernel build for the rest of the process (the next op loads it); `model`'s
    quantized weights are prepared again for it (int4 is held in the dot layout only on
    avx512bf16) and its decode plans rebuilt."""
    from bestiary.core.kernels.cpu import build

    os.environ[build.ISA_ENV_VAR] = isa
    build.library.cache_clear()
    if model is not None:
        for module in model.modules():
            if getattr(module, "quant", None) is not None and hasattr(module.quant, "prepare"):
                module.quant.prepare(module)
        model.__dict__.pop("_decode_plans", None)


def op_cases() -> dict:
    """Op name -> a function that runs it once on SmolLM2-135M decode shapes (batch 1)."""
    from bestiary.core.kernels.cpu import ops

    gen = torch.Generator().manual_seed(0)
    hidden, inter, vocab, heads, kv_heads, d = 576, 1536, 49152, 9, 3, 64
    shapes = [(3 * hidden // 2 + hidden // 2, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter),
              (vocab, hidden)]  # qkv (GQA), o, gate|up, down, lm_head: [N, K]

    def weight(kind: str, n: int, k: int):
        w = torch.randn(n, k, generator=gen)
        if kind in ("fp32", "bf16"):
            return ops.PackedWeight.transposed(w.t().contiguous().to(torch.float32 if kind == "fp32" else torch.bfloat16))
        if kind == "int8":
            return ops.PackedWeight.int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), w[:, 0].abs())
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return ops.PackedWeight.int4(packed, torch.rand(n, k // 64, generator=gen), None, 64)

    cases = {}
    for kind, xdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.bfloat16),
                         ("int4", torch.bfloat16)):
        weights = [weight(kind, n, k) for n, k in shapes]
        xs = [torch.randn(1, k, generator=gen).to(xdtype) for _, k in shapes]
        cases[f"GEMV {kind} (all 5)"] = lambda ws=weights, xs=xs: [ops.linear(x, w) for x, w in zip(xs, ws)]
    blocks, bs = 16, 16
    k_pool, v_pool = torch.randn(blocks, bs, kv_heads, d), torch.randn(blocks, bs, kv_heads, d)
    q, tables, lens = torch.randn(1, heads, d), torch.arange(blocks)[None], torch.tensor([256])
    cases["attention fp32 L=256"] = lambda: ops.decode_attention(q, k_pool, v_pool, tables, lens, 0.125)
    x, w = torch.randn(1, hidden), torch.randn(hidden)
    cases["rms_norm"] = lambda: ops.rms_norm(x, w, 1e-5, x)
    fg = torch.randn(1, 2 * inter)
    cases["silu_and_mul"] = lambda: ops.act_and_mul(fg, "silu")
    qk, cs = torch.randn(1, heads + kv_heads, d), torch.randn(1, 1, d)
    cases["rotary"] = lambda: ops.rotary(qk, cs[..., : d // 2], cs[..., d // 2:], d, "neox")
    kq = torch.zeros(blocks, bs, kv_heads, d, dtype=torch.int8)
    kv, slots, scales = torch.randn(1, kv_heads, d), torch.tensor([5]), torch.tensor([0.1, 0.1])
    cases["kv_write int8"] = lambda: ops.kv_write(kv, kv, kq, kq, slots, scales)
    return cases


def time_ops(isas: list[str], repeats: int) -> None:
    """Per op and ISA: microseconds per call, best of `repeats` interleaved rounds."""
    import time

    from bestiary.core.kernels.cpu import build

    cases, best = op_cases(), {}
    for isa in isas:
        use_isa(isa)
        build.library()
    for _ in range(repeats):
        for name, fn in cases.items():
            for isa in isas:
                use_isa(isa)
                fn()
                calls, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 0.05:
                    fn()
                    calls += 1
                us = (time.perf_counter() - t0) / calls * 1e6
                best[(name, isa)] = min(best.get((name, isa), us), us)
    print(f"{torch.get_num_threads()} threads; load average {os.getloadavg()}; best of {repeats} rounds, us per call")
    print(f"{'op':<24}" + "".join(f"{i:>10}" for i in isas) + "".join(f"{i + '/' + isas[0]:>16}" for i in isas[1:]))
    for name in cases:
        line = f"{name:<24}" + "".join(f"{best[(name, i)]:>10.1f}" for i in isas)
        print(line + "".join(f"{best[(name, isas[0])] / best[(name, i)]:>15.2f}x" for i in isas[1:]))


def main() -> None:
    from transformers import AutoTokenizer

    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.kernels.cpu import build
    from bestiary.core.runtime.llm import LLM

    settings = mode_settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(settings), choices=list(settings))
    parser.add_argument("--isas", nargs="+", default=None, choices=list(build.ISAS),
                        help="builds to compare (default: every one this CPU runs but scalar)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no_llama_cpp", action="store_true")
    parser.add_argument("--ops", action="store_true", help="time the compiled ops alone (speed of each build)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isas or [isa for isa in build.supported_isas() if isa != "scalar"]
    if args.ops:
        return time_ops(isas, args.repeats)
    gguf = demo_model_path()
    ids = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)(PROMPT).input_ids
    cpp = None if args.no_llama_cpp else llama_cpp_seconds(gguf, ids)
    rates: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            dtype, quant = settings[mode]
            ckpt, engine = Path(tmp) / f"{mode}-ckpt", Path(tmp) / f"{mode}-engine"
            convert(gguf, ckpt,
                    ConvertOptions(dtype=dtype, quantization=quant, weight_quantizer="rtn" if quant else None),
                    show_progress=False)
            build_engine(ckpt, engine, BuildConfig(max_batch_size=1, max_seq_len=512))
            llm = LLM(engine)
            runners = {isa: functools.partial(ours_seconds, llm, ids) for isa in isas}
            if cpp is not None:
                runners[LLAMA_CPP] = cpp
            names = list(runners)
            for name in names:  # warm-up (and each build compiled before any timing)
                if name != LLAMA_CPP:
                    use_isa(name, llm.engine.model)
                runners[name](4)
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    if name != LLAMA_CPP:
                        use_isa(name, llm.engine.model)
                    rates.setdefault((mode, name), []).append(decode_rate(runners[name], args.new_tokens))
            del llm
            gc.collect()
    flags = " ".join(sorted(build.cpu_flags())) or "unknown"
    print(f"CPU flags: {flags}")
    print(f"load average (1, 5, 15 min) after the run: {os.getloadavg()}; {torch.get_num_threads()} threads")
    print(f"SmolLM2-135M-Instruct, batch 1, {args.new_tokens} new tokens, median of {args.repeats} rotating rounds"
          + ("" if cpp else "; llama.cpp: not measured"))
    cols = isas + ([LLAMA_CPP] if cpp else [])
    head = f"{'mode':<8}" + "".join(f"{c + ' tok/s':>16}" for c in cols)
    head += "".join(f"{i + '/' + isas[0]:>16}" for i in isas[1:])
    head += "".join(f"{i + '/llama.cpp':>18}" for i in isas) if cpp else ""
    print(head)
    for mode in args.modes:
        med = {c: statistics.median(rates[(mode, c)]) for c in cols}
        line = f"{mode:<8}" + "".join(f"{med[c]:>16.1f}" for c in cols)
        line += "".join(f"{med[i] / med[isas[0]]:>15.2f}x" for i in isas[1:])
        line += "".join(f"{med[i] / med[LLAMA_CPP]:>17.2f}x" for i in isas) if cpp else ""
        print(line)


if __name__ == "__main__":
    main()
