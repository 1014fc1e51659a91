"""Batch-1 decode tokens/s of bestiary vs HF transformers on SmolLM2-135M-Instruct, same run.

HF runs the dense model made once from the same GGUF (core.bench.dense_hf: transformers 5
keeps a GGUF packed and dequantizes per matmul, which is not what a transformers user runs).
`bestiary bench --compare hf,llama.cpp,fastllm` is the CLI form, with every peer. Decode speed is
measured the same way for both: (time to generate 1 + N tokens - time to generate 1) / N,
greedy, EOS ignored, median of --repeats alternating runs. Prints a table with the ratio.

    python benchmarks/decode.py [--new_tokens 64] [--repeats 3] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPT = "Write a short story about a robot who learns to paint."


def hf_generate_seconds(model, ids: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    return time.perf_counter() - t0


def ours_generate_seconds(llm, ids: list[int], n: int) -> float:
    from bestiary.core.runtime.sampling import SamplingConfig

    t0 = time.perf_counter()
    llm.generate([ids], SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def decode_rate(run, n: int) -> float:
    """Tokens/s of the decode phase: N extra tokens over the time they added."""
    first = run(1)
    return n / (run(1 + n) - first)


def main() -> None:
    import transformers

    from bestiary.core.bench.dense_hf import dense_hf_dir
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = demo_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = tokenizer(PROMPT).input_ids
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            ckpt, engine = Path(tmp) / f"{dtype}-ckpt", Path(tmp) / f"{dtype}-engine"
            convert(gguf, ckpt, ConvertOptions(dtype=dtype), show_progress=False)
            build_engine(ckpt, engine, BuildConfig(max_batch_size=1, max_seq_len=512))
            llm = LLM(engine)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(dense_hf_dir(gguf)), dtype=getattr(torch, dtype)).eval()
            ours_rate = functools.partial(ours_generate_seconds, llm, ids)
            hf_rate = functools.partial(hf_generate_seconds, hf, torch.tensor([ids]))
            ours_rate(4), hf_rate(4)  # warm-up
            ours, ref = [], []
            for _ in range(args.repeats):
                ours.append(decode_rate(ours_rate, args.new_tokens))
                ref.append(decode_rate(hf_rate, args.new_tokens))
            rows.append((dtype, statistics.median(ours), statistics.median(ref)))
            del llm, hf
    print(f"SmolLM2-135M-Instruct, batch 1, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(f"{'dtype':<10} {'bestiary tok/s':>15} {'HF tok/s':>10} {'ratio':>7}")
    for dtype, ours, ref in rows:
        print(f"{dtype:<10} {ours:>15.1f} {ref:>10.1f} {ours / ref:>6.2f}x")


if __name__ == "__main__":
    main()
