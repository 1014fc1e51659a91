"""Serving benchmark on SmolLM2-135M-Instruct: bestiary's in-flight batching vs HF transformers.

Same run, same precision, same requests (token ids drawn with a fixed seed); HF runs the dense
model made once from the GGUF (core.bench.dense_hf). `bestiary bench --workloads mixed` is the
CLI form (prompts 16..384, outputs 16..128 by default).

  (b) 64 requests, prompts of 16..512 tokens, max_new_tokens 32..256, all arriving at t=0.
      bestiary: every request goes to the executor at once (in-flight batching, chunked
      prefill, paged KV). HF: static batches of 16 in arrival order, left-padded, each batch run
      to its largest max_new_tokens; only the tokens a request asked for are counted. Reports
      aggregate generated tokens/s, p50/p99 request latency (arrival -> last token) and peak KV
      memory (bestiary: blocks in use; HF: the padded cache of its largest batch).
  (c) time to first token for one 512-token prompt (median of --repeats).

Batch-1 decode speed is benchmarks/decode.py.

    python benchmarks/serving.py [--dtypes bfloat16 float32] [--requests 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bestiary.core.bench.workload import Workload, percentile

HF_BATCH = 16


def make_workload(n: int, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    return Workload(prompts, [rng.randint(32, 256) for _ in range(n)])


def ours_serving(llm, work: Workload) -> tuple[float, list[float], int]:
    """(seconds, per-request latencies, peak KV bytes) for the whole workload at once."""
    from bestiary.core.runtime.sampling import SamplingConfig

    ex = llm.executor
    ex.allocator.peak_used = ex.allocator.num_used
    start = time.perf_counter()
    reqs = [ex.add(p, SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            for p, n in zip(work.prompts, work.max_new)]
    done: dict[int, float] = {}
    while ex.has_work:
        ex.step()
        now = time.perf_counter()
        for r in reqs:
            if r.finished and r.id not in done:
                done[r.id] = now - start
    seconds = time.perf_counter() - start
    assert all(len(r.output) == n for r, n in zip(reqs, work.max_new))
    return seconds, [done[r.id] for r in reqs], ex.peak_kv_bytes


def hf_serving(model, work: Workload, kv_bytes_per_token: int) -> tuple[float, list[float], int]:
    """Static batches of HF_BATCH in arrival order, left-padded, each to its largest max_new_tokens."""
    latencies, peak = [], 0
    start = time.perf_counter()
    for b in range(0, len(work.prompts), HF_BATCH):
        prompts, news = work.prompts[b : b + HF_BATCH], work.max_new[b : b + HF_BATCH]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news),
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        now = time.perf_counter() - start
        latencies += [now] * len(prompts)
        peak = max(peak, len(prompts) * (width + max(news)) * kv_bytes_per_token)
    return time.perf_counter() - start, latencies, peak


def ours_ttft(llm, prompt: list[int]) -> float:
    from bestiary.core.runtime.sampling import SamplingConfig

    start = time.perf_counter()
    llm.generate([prompt], SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start


def hf_ttft(model, prompt: list[int]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    import transformers

    from bestiary.core.bench.dense_hf import dense_hf_dir
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.kv_cache import KVCache
    from bestiary.core.runtime.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_num_tokens", type=int, default=512, help="bestiary's tokens per step (prefill chunk)")
    args = parser.parse_args()
    gguf = demo_model_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            ckpt, engine = Path(tmp) / f"{dtype}-ckpt", Path(tmp) / f"{dtype}-engine"
            convert(gguf, ckpt, ConvertOptions(dtype=dtype), show_progress=False)
            build_engine(ckpt, engine, BuildConfig(max_batch_size=args.requests, max_seq_len=1024,
                                                   max_num_tokens=args.max_num_tokens))
            llm = LLM(engine)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(dense_hf_dir(gguf)), dtype=getattr(torch, dtype)).eval()
            work = make_workload(args.requests, llm.engine.model.config.vocab_size)
            ours_ttft(llm, work.prompts[0][:32]), hf_ttft(hf, work.prompts[0][:32])  # warm-up
            ttft_prompt = make_workload(1, llm.engine.model.config.vocab_size, seed=1).prompts[0]
            ttft_prompt = (ttft_prompt * 2)[:512]
            ours_t = statistics.median(ours_ttft(llm, ttft_prompt) for _ in range(args.repeats))
            hf_t = statistics.median(hf_ttft(hf, ttft_prompt) for _ in range(args.repeats))
            o_sec, o_lat, o_kv = ours_serving(llm, work)
            h_sec, h_lat, h_kv = hf_serving(hf, work, KVCache.bytes_per_token_for(llm.engine.model))
            rows.append((dtype, work.asked, (o_sec, o_lat, o_kv, ours_t), (h_sec, h_lat, h_kv, hf_t)))
            del llm, hf
    print(f"SmolLM2-135M-Instruct, {args.requests} requests (prompts 16..512, max_new_tokens 32..256), "
          f"{torch.get_num_threads()} threads; HF: static batches of {HF_BATCH}")
    head = f"{'dtype':<9} {'engine':<9} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'peak KV MiB':>12} {'TTFT 512 ms':>12}"
    print(head)
    for dtype, asked, ours, ref in rows:
        for name, (sec, lat, kv, ttft) in (("bestiary", ours), ("HF", ref)):
            print(f"{dtype:<9} {name:<9} {asked / sec:>8.1f} {percentile(lat, 50):>7.1f} {percentile(lat, 99):>7.1f} "
                  f"{kv / 2**20:>12.1f} {ttft * 1000:>12.1f}")
        print(f"{dtype:<9} {'ratio':<9} {ref[0] / ours[0]:>7.2f}x {'':>7} {'':>7} {'':>12} "
              f"{ours[3] / ref[3]:>11.2f}x")


if __name__ == "__main__":
    main()
