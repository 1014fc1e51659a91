"""Perplexity of W8A8 / W4A8 dynamic (W8A16 / W4A16 weights, int8 activations per token) against W8A16 /
W4A16 and the float model.

SmolLM2-135M-Instruct from its GGUF, the text and windows of tests/quant/test_quant_smollm2.py (4096 tokens
of standard-library module docstrings, windows of 2048), engines built with max_num_tokens 512 (prefill
chunks of 512 on the int8-activation kernels). Modes: fp32, W8A16, W8A8 (fp32 activations between the
linears); with --bf16 also bf16, W8A16 and W8A8 in bfloat16. With --int4: fp32, W4A16 (GPTQ, groups of 128,
convert's default for int4) and W4A8, the very same int4 checkpoint with `activation_quant: int8` set.

    python benchmarks/a8_quality.py [--tokens 4096] [--bf16] [--int4]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import shutil
import tempfile
import time
from pathlib import Path

TEXT_MODULES = ("argparse", "json", "csv", "statistics", "re", "http.client", "urllib.request", "ssl", "socket",
                "unittest", "heapq", "itertools", "pydoc", "inspect", "doctest", "subprocess", "random", "typing")


def eval_text() -> str:
    """tests/quant/test_quant_smollm2.py's evaluation text."""
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in TEXT_MODULES)


def with_int8_activations(ckpt: Path, out: Path) -> Path:
    """A copy of checkpoint `ckpt` whose quantization section asks for int8 activations (same weights)."""
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization"]["activation_quant"] = "int8"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def measure(gguf: Path, base: Path, name: str, dtype: str, quant, tokens: int) -> float:
    """Perplexity of one mode's engine over the first `tokens` tokens of the text (quant "W4A8": the W4A16
    checkpoint measured before, with int8 activations)."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.evaluate import perplexity

    if quant == "W4A8":
        ckpt = with_int8_activations(base / f"{dtype}-W4A16-ckpt", base / f"{name}-ckpt")
    else:
        ckpt = convert(gguf, base / f"{name}-ckpt", ConvertOptions(dtype=dtype, quantization=quant),
                       show_progress=False)
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
    parser.add_argument("--int4", action="store_true", help="W4A16 and W4A8 instead of W8A16 and W8A8")
    args = parser.parse_args()
    gguf = demo_model_path()
    modes = {"float": QuantConfig(), "W8A16": QuantConfig(quant_algo="W8A16"),
             "W8A8": QuantConfig(quant_algo="W8A16", activation_quant="int8")}
    if args.int4:
        modes = {"float": QuantConfig(), "W4A16": QuantConfig(quant_algo="W4A16", group_size=128), "W4A8": "W4A8"}
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
