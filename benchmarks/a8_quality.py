"""Perplexity of W8A8 dynamic (W8A16 weights, int8 activations per token) against W8A16 and the float model.

SmolLM2-135M-Instruct from its GGUF, the text and windows of tests/quant/test_quant_smollm2.py (4096 tokens
of standard-library module docstrings, windows of 2048), engines built with max_num_tokens 512 (prefill
chunks of 512 on the int8 x int8 kernel). Modes: fp32, W8A16, W8A8 (fp32 activations between the
linears); with --bf16 also bf16, W8A16 and W8A8 in bfloat16.

    python benchmarks/a8_quality.py [--tokens 4096] [--bf16]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import tempfile
import time
from pathlib import Path

TEXT_MODULES = ("argparse", "json", "csv", "statistics", "re", "http.client", "urllib.request", "ssl", "socket",
                "unittest", "heapq", "itertools", "pydoc", "inspect", "doctest", "subprocess", "random", "typing")


def eval_text() -> str:
    """tests/quant/test_quant_smollm2.py's evaluation text."""
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in TEXT_MODULES)


def measure(gguf: Path, base: Path, name: str, dtype: str, quant, tokens: int) -> float:
    """Perplexity of one mode's engine over the first `tokens` tokens of the text."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.evaluate import perplexity

    ckpt = convert(gguf, base / f"{name}-ckpt", ConvertOptions(dtype=dtype, quantization=quant), show_progress=False)
    build_engine(ckpt, base / name, BuildConfig(max_seq_len=2048, max_num_tokens=512))
    engine = Engine.load(base / name)
    ids = engine.tokenizer.encode(eval_text())[:tokens]
    return perplexity(engine, ids).perplexity


def main() -> None:
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.format.config import QuantConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--bf16", action="store_true", help="also the bfloat16 engines")
    args = parser.parse_args()
    gguf = demo_model_path()
    modes = {"float": QuantConfig(), "W8A16": QuantConfig(quant_algo="W8A16"),
             "W8A8": QuantConfig(quant_algo="W8A16", activation_quant="int8")}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16") if args.bf16 else ("float32",):
            base = None
            for name, quant in modes.items():
                start = time.perf_counter()
                ppl = measure(gguf, Path(tmp), f"{dtype}-{name}", dtype, quant, args.tokens)
                base = ppl if base is None else base
                print(f"{dtype:8s} {name:6s} perplexity {ppl:.4f}  {100 * (ppl / base - 1):+.2f}% vs {dtype} float"
                      f"  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
