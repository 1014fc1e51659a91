"""Tensor parallelism on the CPU: resident memory per rank and decode tokens/s, tp 2 vs tp 1.

A random LLaMA (hidden 1024, 8 layers, 16 heads / 4 kv heads, FFN 2816, vocab 32000: 155M
parameters, 620 MB in fp32) is converted at tp 1 and tp 2. In the same run:

- tp 1 with 2 torch threads, tp 2 with 1 thread per rank (the same 2 cores), and tp 1 with 1 thread;
- per rank: VmRSS after loading, and the bytes of its rank file;
- greedy decode of 64 tokens after a 32-token prompt, batch 1, best of 3 (tokens/s of decode).

Usage: python benchmarks/tp_scaling.py [--workdir DIR]. The machine may be shared: the ratio of
the two runs, taken back to back, is the figure to read.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

CONFIG = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 512,
          "tie_word_embeddings": False}


def rss_mb(pid: int) -> float:
    """VmRSS of a process in MiB."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def make_checkpoints(workdir: Path) -> tuple[Path, Path]:
    import transformers

    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    if not (workdir / "tp2").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        model.save_pretrained(workdir / "hf")
        convert(workdir / "hf", workdir / "tp1", ConvertOptions(dtype="float32"), show_progress=False)
        convert(workdir / "hf", workdir / "tp2", ConvertOptions(dtype="float32", tp_size=2), show_progress=False)
    return workdir / "tp1", workdir / "tp2"


def decode_rate(llm, tokens: int = 64) -> float:
    from bestiary.core.runtime.sampling import SamplingConfig

    prompt = list(range(100, 132))
    sampling = SamplingConfig(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    best = 0.0
    for _ in range(3):
        llm.generate([prompt], sampling)
        best = max(best, llm.last_stats.decode_tokens_per_second)
    return best


def measure(ckpt: Path, threads: int) -> dict:
    """In this process: load `ckpt` (its ranks spawned), RSS of every rank, decode tokens/s."""
    from bestiary.core.runtime.llm import LLM

    llm = LLM(ckpt, num_threads=threads)
    group = llm.engine.group
    pids = [os.getpid()] + ([s.process.pid for s in group.spawned] if group is not None else [])
    rate = decode_rate(llm)
    return {"rss_mib": [round(rss_mb(pid)) for pid in pids], "decode_tok_s": round(rate, 2)}


def main() -> None:
    import json
    import subprocess
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one checkpoint
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one), args.threads)))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bestiary-tp-"))
    tp1, tp2 = make_checkpoints(workdir)
    files = {p: [f.stat().st_size / 2**20 for f in sorted(p.glob("rank*.safetensors"))] for p in (tp1, tp2)}
    print(f"load average before: {os.getloadavg()}")
    runs = []
    for _ in range(2):  # alternated, each in a fresh process: a shared machine's load hits both alike
        for ckpt, threads in ((tp1, 2), (tp2, 1), (tp1, 1)):
            out = subprocess.run([sys.executable, __file__, "--one", str(ckpt), "--threads", str(threads)],
                                 capture_output=True, text=True, check=True).stdout
            runs.append((ckpt, threads, json.loads(out.strip().splitlines()[-1])))
    for ckpt, threads, r in runs:
        print(f"{ckpt.name} ({threads} thread(s) per rank): decode {r['decode_tok_s']:6.2f} tok/s; RSS per rank "
              f"{r['rss_mib']} MiB; rank files {[round(f) for f in files[ckpt]]} MiB")
    rate = {(c, t): max(r["decode_tok_s"] for k, n, r in runs if (k, n) == (c, t)) for c, t in ((tp1, 2), (tp2, 1), (tp1, 1))}
    print(f"best decode: tp 1 (2 threads) {rate[tp1, 2]:.2f}, tp 2 (1 thread per rank) {rate[tp2, 1]:.2f}, "
          f"tp 1 (1 thread) {rate[tp1, 1]:.2f} tok/s; tp 2 / tp 1 (2 threads) = {rate[tp2, 1] / rate[tp1, 2]:.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
