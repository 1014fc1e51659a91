"""Per-op profile of a CPU decode step (issue 27): where a batch-1 and a 32-sequence step go.

An engine (default: SmolLM2-135M-Instruct from the demo GGUF, converted at --dtype, optionally
--quant W8A16 / W4A16) decodes `--tokens` greedy tokens for each batch size after a `--prompt`-token prompt
per sequence (64 by default; context grows from it). Every record of the compiled decode plan is timed
(core.runtime.cpu_plan.DecodePlan.start_profile: one compiled call per record), and the rest of a step
(the executor, sampling, Python) is the step's wall time minus the plan's. Printed per batch size:
ms per step for each op kind (linears by shape and weight kind), summed over the layers, and %.

Usage: python benchmarks/profile_step.py [--dtype bfloat16] [--quant W8A16] [--batches 1 32]
       [--tokens 32] [--prompt 64] [--threads 2] [--workdir DIR]
       python benchmarks/profile_step.py --engine_dir DIR   (any built engine: W8A8, W4A8, another model)
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path


def engine_dir(workdir: Path, dtype: str, quant: str | None) -> Path:
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.config import QuantConfig

    tag = f"{dtype}-{quant or 'float'}"
    engine = workdir / f"engine-{tag}"
    if not (engine / "config.json").is_file():
        q = QuantConfig(quant_algo=quant) if quant else None
        ckpt = convert(demo_model_path(), workdir / f"ckpt-{tag}",
                       ConvertOptions(dtype=dtype, quantization=q, weight_quantizer="rtn" if q else None),
                       show_progress=False)
        build_engine(ckpt, engine, BuildConfig(max_batch_size=64, max_seq_len=512))
    return engine


def profile(llm, batch: int, tokens: int, prompt: int = 64) -> tuple[dict[str, float], float, int]:
    """(ms per step by op label, ms per step outside the plan, steps) of `batch` sequences decoding."""
    from bestiary.core.runtime.sampling import SamplingConfig

    model = llm.engine.model
    prompts = [[100 + 7 * i + j for i in range(prompt)] for j in range(batch)]
    sampling = SamplingConfig(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    # builds the plan: prompts longer than a step's max_num_tokens take several prefill steps, and
    # the first sequences decode beside the last ones' prefill, so a step of `batch` needs a few tokens
    llm.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=min(tokens, 8), ignore_eos=True))
    plan = model.__dict__["_decode_plans"][batch]
    plan.start_profile()
    before = model.__dict__.get("plan_steps", 0)
    t0 = time.perf_counter()
    llm.generate(prompts, sampling)
    wall = time.perf_counter() - t0
    steps = model.__dict__.get("plan_steps", 0) - before
    per_op: dict[str, float] = collections.defaultdict(float)
    for label, seconds in plan.profile_rows():
        per_op[label] += 1e3 * seconds / steps
    prefill = llm.last_stats.first_token_seconds
    rest = 1e3 * (wall - prefill) / steps - sum(per_op.values())  # the decode steps' time outside the plan
    return dict(per_op), rest, steps


def main() -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    from bestiary.core.runtime.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--quant", default=None, choices=["W8A16", "W4A16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence (context grows from it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--engine_dir", default=None, help="profile this built engine (--dtype / --quant unused)")
    parser.add_argument("--max_kernel_tokens", type=int, default=None,
                        help="weight-only int8 / int4 layers: the compiled GEMV up to this many rows (default: the "
                             "build's bound, core.quant.slot.COMPILED_MAX_TOKENS)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bestiary-profile-"))
    llm = LLM(Path(args.engine_dir) if args.engine_dir else engine_dir(workdir, args.dtype, args.quant))
    if args.max_kernel_tokens is not None:
        from bestiary.core.quant.apply import set_max_kernel_tokens

        set_max_kernel_tokens(llm.engine.model, args.max_kernel_tokens)
    console = Console()
    console.print(f"load average {os.getloadavg()}, {args.threads} threads, {args.dtype} {args.quant or ''}")
    for batch in args.batches:
        per_op, rest, steps = profile(llm, batch, args.tokens, args.prompt)
        total = sum(per_op.values()) + rest
        table = Table(title=f"batch {batch}: {total:.2f} ms per decode step ({steps} steps, "
                            f"{1e3 * batch / total:.1f} tok/s)")
        for col in ("op", "ms / step", "%"):
            table.add_column(col, justify="right" if col != "op" else "left")
        for label, ms in sorted(per_op.items(), key=lambda kv: -kv[1]):
            table.add_row(label, f"{ms:.3f}", f"{100 * ms / total:.1f}")
        table.add_row("outside the plan (executor, sampling)", f"{rest:.3f}", f"{100 * rest / total:.1f}")
        console.print(table)


if __name__ == "__main__":
    main()
