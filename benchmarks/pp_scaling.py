"""Pipeline parallelism on the CPU: memory per rank, decode and mixed-workload tokens/s, the bubble.

SmolLM2-135M-Instruct (the demo GGUF, bf16) converted at tp 1 and pp 2 (15 + 15 layers). In the same
run, each configuration in a fresh process, alternated over the rounds:

- tp 1 with 2 torch threads, pp 2 with 1 thread per rank (the same 2 cores), tp 1 with 1 thread;
- per rank: the bytes of its rank file and VmRSS after loading;
- batch-1 greedy decode of 64 tokens after a 32-token prompt (best of 3, tokens/s of decode);
- the mixed workload: 16 requests, prompts of 16..256 tokens, outputs of 16..64, submitted at once
  (generated tokens / wall time);
- pp 2 only: each rank's PipelineStats over the mixed workload (busy / wall: its bubble), with the
  default micro-batches (2 x pp) and with BESTIARY_PP_MICRO_BATCHES=1 (no overlap).

Usage: python benchmarks/pp_scaling.py [--workdir DIR] [--rounds 2]. The machine may be shared: read
the ratios of configurations measured back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) / 1024


def make_checkpoints(workdir: Path) -> dict[str, Path]:
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    out = {"tp1": workdir / "tp1", "pp2": workdir / "pp2"}
    for name, pp in (("tp1", 1), ("pp2", 2)):
        if not out[name].exists():
            convert(demo_model_path(), out[name], ConvertOptions(dtype="bfloat16", pp_size=pp), show_progress=False)
    return out


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(16, 256))], rng.randint(16, 64)) for _ in range(16)]


def measure(ckpt: Path, threads: int, micro: str | None) -> dict:
    """In this process: load `ckpt` (ranks spawned), RSS per rank, decode and mixed tokens/s, stage stats."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.core.runtime.step_broadcast import check_mirror

    if micro:
        os.environ["BESTIARY_PP_MICRO_BATCHES"] = micro  # read on the driver, sent with each step
    llm = LLM(ckpt, num_threads=threads)
    group = llm.engine.group
    pids = [os.getpid()] + ([s.process.pid for s in group.spawned] if group is not None else [])
    rss = [round(rss_mib(pid)) for pid in pids]
    decode = 0.0
    for _ in range(3):
        llm.generate([list(range(100, 132))], SamplingConfig(temperature=0, max_new_tokens=64, ignore_eos=True))
        decode = max(decode, llm.last_stats.decode_tokens_per_second)
    work = workload()
    before = [r["pipeline"] for r in check_mirror(llm.engine)] if group is not None else None
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work],
                        [SamplingConfig(temperature=0, max_new_tokens=n, ignore_eos=True) for _, n in work])
    mixed = sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t0)
    stages = None
    if group is not None:
        after = [r["pipeline"] for r in check_mirror(llm.engine)]
        stages = [{"busy_s": round(a["busy_s"] - b["busy_s"], 3), "wall_s": round(a["wall_s"] - b["wall_s"], 3),
                   "steps": a["steps"] - b["steps"], "micro_batches": a["micro_batches"] - b["micro_batches"]}
                  for a, b in zip(after, before)]
        for s in stages:
            s["bubble"] = round(1 - s["busy_s"] / s["wall_s"], 3) if s["wall_s"] else 0.0
    llm.close()
    return {"rss_mib": rss, "decode_tok_s": round(decode, 2), "mixed_tok_s": round(mixed, 2), "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one checkpoint
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--micro", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one), args.threads, args.micro)))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bestiary-pp-"))
    ckpts = make_checkpoints(workdir)
    files = {n: [round(f.stat().st_size / 2**20, 1) for f in sorted(p.glob("rank*.safetensors"))] for n, p in ckpts.items()}
    print(f"load average before: {os.getloadavg()}")
    configs = [("tp1", 2, None), ("pp2", 1, None), ("pp2", 1, "1"), ("tp1", 1, None)]
    runs = []
    for _ in range(args.rounds):
        for name, threads, micro in configs:
            cmd = [sys.executable, __file__, "--one", str(ckpts[name]), "--threads", str(threads)]
            out = subprocess.run(cmd + (["--micro", micro] if micro else []), capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append((name, threads, micro, r))
            label = f"{name} ({threads} thread(s)/rank{', M=' + micro if micro else ''})"
            print(f"{label:28s} decode {r['decode_tok_s']:6.2f} tok/s  mixed {r['mixed_tok_s']:6.2f} tok/s  "
                  f"RSS/rank {r['rss_mib']} MiB  files {files[name]} MiB  stages {r['stages']}", flush=True)
    best = {c[:3]: max((r for n, t, m, r in runs if (n, t, m) == c[:3]), key=lambda r: r["decode_tok_s"]) for c in configs}
    base = best["tp1", 2, None]
    for c in configs:
        r = best[c]
        print(f"best {c}: decode {r['decode_tok_s'] / base['decode_tok_s']:.2f}x, mixed "
              f"{r['mixed_tok_s'] / base['mixed_tok_s']:.2f}x of tp 1 (2 threads)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
