"""Resident memory of a loaded engine against its weights on disk and its KV pool (issue: memory no larger
than the weights). Each engine loads in a fresh process; /proc/self/status gives:

    base    VmRSS after importing bestiary's runtime (torch, tokenizers, the registry): not the engine's
    peak    VmHWM - base: the high-water mark while loading (weights read, repacked, sources freed)
    loaded  VmRSS - base right after LLM(engine) returns
    steady  VmRSS - base after the KV pool is committed (every page touched) and a short generate; also its
            RssAnon part (private memory: what the engine holds; the rest is file pages, mostly the code of
            the libraries the first step runs, the same for every model size)

ratios are over the engine's rank-0 .safetensors bytes + its KV pool bytes (K + V as allocated).

    python benchmarks/engine_memory.py ENGINE_DIR [ENGINE_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from pathlib import Path

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, value = line.split(":", 1)
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
base = status()
start = time.perf_counter()
llm = LLM(sys.argv[1])
load_s = time.perf_counter() - start
loaded = status()
llm.executor.kv.commit()
llm.generate([[1, 450, 4996, 17354, 1701, 29916]], SamplingConfig(max_new_tokens=4))  # ids: engines without a tokenizer
steady = status()
kv = llm.executor.kv
weights = sum(p.stat().st_size for p in Path(sys.argv[1]).glob("rank0.safetensors"))
print(json.dumps({"base": base, "loaded": loaded, "steady": steady, "load_s": load_s, "weights": weights,
                  "kv": kv.k.nbytes + kv.v.nbytes}))
"""


def measure(engine: str) -> dict:
    """The child's figures for one engine (a fresh process)."""
    out = subprocess.run([sys.executable, "-c", CHILD, engine], capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        print(f"engine_memory.py: {engine}: could not load: {last}", file=sys.stderr)
        sys.exit(2)
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(engine: str, m: dict) -> str:
    """One table row: sizes in MiB, ratios over weights + KV."""
    mib = 2**20
    base = m["base"]["VmRSS"]
    peak, loaded, steady = m["loaded"]["VmHWM"] - base, m["loaded"]["VmRSS"] - base, m["steady"]["VmRSS"] - base
    anon = m["steady"]["RssAnon"] - m["base"]["RssAnon"]
    whole = m["weights"] + m["kv"]
    return (f"| {engine} | {m['weights'] / mib:.0f} | {m['kv'] / mib:.0f} | {peak / mib:.0f} ({peak / whole:.2f}x) | "
            f"{loaded / mib:.0f} ({loaded / whole:.2f}x) | {steady / mib:.0f} ({steady / whole:.2f}x) | "
            f"{anon / mib:.0f} ({anon / whole:.2f}x) | {m['load_s']:.2f} |")


def main(engines: list[str]) -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, load average {open('/proc/loadavg').read().split()[0]}")
    print("| engine | weights MiB | KV pool MiB | peak while loading | after load | steady | steady, private | load s |")
    print("|---|---|---|---|---|---|---|---|")
    for engine in engines:
        print(row(engine, measure(engine)), flush=True)


def parse(argv: list[str]) -> list[str]:
    """The engine directories to measure, from the command line."""
    parser = argparse.ArgumentParser(description="Resident memory of loaded engines against weights + KV pool.")
    parser.add_argument("engines", nargs="+", metavar="ENGINE_DIR", help="engine directories, each loaded in a "
                        "fresh process (no default)")
    return parser.parse_args(argv).engines


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
