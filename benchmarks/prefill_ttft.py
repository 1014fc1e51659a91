"""Time to the first token with the compiled bf16 prefill attention against the torch path it replaced.

One built engine (bfloat16 activations: a bf16 or W4A16 / W4A8 engine) answers fresh prompts of each length in
--lengths with one new token, the compiled prefill attention (`attention_ref.compiled_prefill`) switched on
and off in turn in the same process (off: torch's SDPA on keys padded to whole blocks of 512, what the avx2 and
avx512 builds ran before). Every prompt is new (no cached prefix). Printed per length: the median time to the
first token over --rounds alternated rounds, each way, and off / on.

    python benchmarks/prefill_ttft.py ENGINE_DIR [--lengths 2 16 64 256 512] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path


def main() -> None:
    import torch

    from bestiary.core.kernels import attention_ref
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", help="a built engine directory")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 16, 64, 256, 512],
                        help="prompt lengths in tokens (default: 2 16 64 256 512)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds, median taken (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch / kernel threads (default: 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = attention_ref.compiled_prefill
    llm = LLM(Path(args.engine_dir))
    one = SamplingConfig(temperature=0, max_new_tokens=1, ignore_eos=True)
    llm.generate([[5, 6, 7]], one)  # the first step's one-off costs (imports, plan) out of the figures
    seconds: dict[tuple[int, bool], list[float]] = {}
    prompt = 0
    for _ in range(args.rounds):
        for length in args.lengths:
            for on in (True, False):
                attention_ref.compiled_prefill = compiled if on else (lambda *a: False)
                prompt += 1  # a fresh prompt each time: no cached prefix
                llm.generate([[100 + 7 * i + 13 * prompt for i in range(length)]], one)
                seconds.setdefault((length, on), []).append(llm.last_stats.first_token_seconds or 0.0)
    attention_ref.compiled_prefill = compiled
    print(f"{args.engine_dir}: {args.threads} threads, load average {os.getloadavg()}")
    for length in args.lengths:
        on, off = (statistics.median(seconds[(length, c)]) for c in (True, False))
        print(f"{length:5d} tokens: compiled {1e3 * on:8.1f} ms   torch SDPA (padded) {1e3 * off:8.1f} ms   "
              f"{off / on:.2f}x")


if __name__ == "__main__":
    main()
