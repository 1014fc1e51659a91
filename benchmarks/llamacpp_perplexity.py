"""llama.cpp's perplexity cost of its own quantizations, the outside reference of the gates in
tests/quant/test_quant_smollm2.py: the same tokens (that test's text, first EVAL_TOKENS tokens of the
engine's tokenizer) in the same 2048-token windows as bestiary.core.runtime.evaluate.

F32 is llama.cpp's dequantization of the shipped Q4_1 GGUF (the weights the fp32 engine runs);
the others are requantized from it by llama_model_quantize. Needs llama-cpp-python (extra
`bench`) and a built SmolLM2 engine (for the tokenizer; `bestiary demo` leaves one):

    python benchmarks/llamacpp_perplexity.py --engine_dir ~/.cache/bestiary/demo/smollm2-float32-engine

`--kv` measures instead the cost of llama.cpp's quantized KV caches (the outside reference of
the INT8_KV / FP8_KV gates): the F32 weights with K and V stored as f32 (no flash attention,
and with it), f16, q8_0 and q4_0 (quantized V needs flash attention in llama.cpp).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

from bestiary.core.cli.demo import demo_model_path
from bestiary.core.runtime.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
__import__("sys_path").add()  # the tests' helpers and test modules
from test_quant_smollm2 import EVAL_TOKENS, eval_text  # noqa: E402

FTYPES = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
          "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}
# --kv: name -> (ggml type of K and V, flash attention); ggml types: 0 f32, 1 f16, 2 q4_0, 8 q8_0
KV_TYPES = {"kv_f32": (0, False), "kv_f32_fa": (0, True), "kv_f16_fa": (1, True), "kv_q8_0_fa": (8, True),
            "kv_q4_0_fa": (2, True)}


def requantize(src: Path, ftype: int, out: Path, threads: int) -> Path:
    """llama.cpp's `quantize` of `src` to `ftype` (dequantizing first: allow_requantize)."""
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
        if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize failed for {out}")
    return out


def perplexity(path: Path, ids: list[int], window: int, threads: int, kv_type: int = 1,
               flash: bool = False) -> float:
    """exp(mean NLL) of ids, window by window (each window from an empty cache); K and V cached
    as ggml type `kv_type` (llama.cpp's default f16)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=window, n_batch=512, logits_all=True, n_threads=threads,
                          verbose=False, type_k=kv_type, type_v=kv_type, flash_attn=flash)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[: len(chunk)], dtype=np.float64)  # [T, V]
        top = logits.max(-1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        total += float((lse[:-1] - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
        count += len(chunk) - 1
    return math.exp(total / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine_dir", required=True, help="a SmolLM2 engine (its tokenizer makes the tokens)")
    ap.add_argument("--workdir", default="/tmp/llamacpp_ppl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--kv", action="store_true", help="KV cache types on the F32 weights instead of weight types")
    args = ap.parse_args()
    ids = Engine.load(args.engine_dir).tokenizer.encode(eval_text())[:EVAL_TOKENS]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    base = None
    if args.kv:
        gguf = requantize(demo_model_path(), FTYPES["f32"], work / "smollm2-f32.gguf", args.threads)
        for name, (kv_type, flash) in KV_TYPES.items():
            t0 = time.perf_counter()
            ppl = perplexity(gguf, ids, args.window, args.threads, kv_type, flash)
            base = base or ppl
            seconds = time.perf_counter() - t0
            print(f"{name}: perplexity {ppl:.4f} ({100 * (ppl / base - 1):+.3f}% vs kv_f32, {seconds:.0f} s)")
        return 0
    for name, ftype in FTYPES.items():
        t0 = time.perf_counter()
        gguf = requantize(demo_model_path(), ftype, work / f"smollm2-{name}.gguf", args.threads)
        ppl = perplexity(gguf, ids, args.window, args.threads)
        base = base or ppl
        seconds = time.perf_counter() - t0
        print(f"{name}: perplexity {ppl:.4f} ({100 * (ppl / base - 1):+.2f}% vs f32, {seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
