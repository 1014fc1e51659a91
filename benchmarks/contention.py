"""Decode speed on a shared CPU: bestiary's thread settings with 0, 1 and 2 competing busy processes.

Each case runs a fresh `python` that loads a SmolLM2 engine and decodes 32 greedy tokens three times
(the median decode tok/s is its reading), while `busy` processes (`while True: pass`, each pinned to
one CPU) compete, pinned itself to one CPU (`taskset`), or in a cgroup v1 with a CPU quota of one CPU
(`quota`: made under /sys/fs/cgroup/cpu when this user may, else the case is skipped).
Settings, each by its environment only, so one engine serves all:

  default      what bestiary does when nothing is set: threads follow the CPUs the other processes leave
               (core.runtime.threads.ThreadGovernor), libgomp's own waiting policy
  fixed-all    BESTIARY_NUM_THREADS=<usable CPUs>: every usable CPU, all the time (bestiary before the
               busy-CPU issue)
  threads-1    BESTIARY_NUM_THREADS=1
  passive      OMP_WAIT_POLICY=PASSIVE with every usable CPU: idle OpenMP threads sleep at once
  llama.cpp    the peer (llama-cpp-python, the bench extra) on the same model's shipped Q4_1 GGUF, with
               llama-cpp-python's default threads (half the CPUs: 1 here) and with every usable CPU
               (llama.cpp-all); compare each engine's drop from its own idle reading (a W4A16 engine,
               `--dtype w4a16`, is llama.cpp's Q4_1 at equal bits)

Rounds alternate the settings within each load; the table gives medians over rounds, and the
ratio of each setting to the best one of its load. Usage:

    python benchmarks/contention.py [--dtype bfloat16|w4a16] [--rounds 3] [--loads 0,1,2,taskset,quota]
        [--settings default,fixed-all,threads-1,passive,llama.cpp,llama.cpp-all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "fixed-all": {"BESTIARY_NUM_THREADS": str(len(os.sched_getaffinity(0)))},
    "threads-1": {"BESTIARY_NUM_THREADS": "1"},
    "passive": {"BESTIARY_NUM_THREADS": str(len(os.sched_getaffinity(0))), "OMP_WAIT_POLICY": "PASSIVE"},
    "llama.cpp": {},
    "llama.cpp-all": {},
}
PEER_THREADS = {"llama.cpp": None, "llama.cpp-all": len(os.sched_getaffinity(0))}  # None: llama-cpp-python's default
CHILD = """
import json, statistics, sys
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
llm = LLM(sys.argv[1])
cfg = SamplingConfig(max_new_tokens=32, temperature=0.0, ignore_eos=True)
llm.generate("Tell me a story about a dragon.", cfg)  # warm-up
rates = []
for _ in range(3):
    llm.generate("Tell me a story about a dragon.", cfg)
    rates.append(llm.last_stats.decode_tokens_per_second)
import torch
print(json.dumps({"rate": statistics.median(rates), "threads": torch.get_num_threads()}))
"""
LLAMA_CPP_CHILD = """
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama
kwargs = {"n_threads": int(sys.argv[2])} if sys.argv[2] != "default" else {}
llm = Llama(model_path=sys.argv[1], n_ctx=512, verbose=False, **kwargs)
prompt = llm.tokenize(b"Tell me a story about a dragon.")
def decode(n=32):
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return n / (time.perf_counter() - start)
decode()  # warm-up
print(json.dumps({"rate": statistics.median(decode() for _ in range(3)), "threads": llm.n_threads}))
"""


def engine(workdir: Path, dtype: str) -> Path:
    """The SmolLM2 engine of `dtype`, built once under `workdir`."""
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    out = workdir / f"smollm2-{dtype}-engine"
    if not (out / "config.json").is_file():
        from bestiary.core.format.config import QuantConfig

        options = (ConvertOptions(dtype="bfloat16", quantization=QuantConfig(quant_algo="W4A16"),
                                  weight_quantizer="rtn") if dtype == "w4a16" else ConvertOptions(dtype=dtype))
        ckpt = convert(demo_model_path(), workdir / f"smollm2-{dtype}-ckpt", options)
        build_engine(ckpt, out, BuildConfig(max_batch_size=4, max_seq_len=512))
    return out


def busy(count: int) -> list[subprocess.Popen]:
    """`count` spinning processes, process i pinned to CPU i (mod the CPUs this process may use)."""
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(count):
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(p.pid, {cpus[i % len(cpus)]})
        procs.append(p)
    return procs


QUOTA_DIR = Path("/sys/fs/cgroup/cpu/bestiary_contention")


def quota_cgroup() -> Path | None:
    """A cgroup v1 CPU controller dir with a quota of 1 CPU (100 ms per 100 ms), or None where none can be made."""
    try:
        QUOTA_DIR.mkdir(exist_ok=True)
        (QUOTA_DIR / "cpu.cfs_period_us").write_text("100000")
        (QUOTA_DIR / "cpu.cfs_quota_us").write_text("100000")
        return QUOTA_DIR
    except OSError:
        return None


def wrapped(cmd: list[str], load: str) -> list[str]:
    """`cmd` pinned to one CPU (taskset) or started inside the quota cgroup (quota)."""
    if load == "taskset":
        return ["taskset", "-c", str(min(os.sched_getaffinity(0))), *cmd]
    if load == "quota":
        return ["sh", "-c", f'echo $$ > {QUOTA_DIR}/cgroup.procs && exec "$@"', "sh", *cmd]
    return cmd


def run_case(engine_dir: Path, setting: str, load: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                            "BESTIARY_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update({k: v for k, v in SETTINGS[setting].items() if v})
    if setting in PEER_THREADS:  # the shipped GGUF, in llama.cpp
        from bestiary.core.cli.demo import demo_model_path

        threads = PEER_THREADS[setting]
        child = [LLAMA_CPP_CHILD, str(demo_model_path()), "default" if threads is None else str(threads)]
    else:
        child = [CHILD, str(engine_dir)]
    cmd = wrapped([sys.executable, "-c", *child], load)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{setting}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16",
                        help="Engine dtype, or w4a16 (int4 weights, bf16: llama.cpp's Q4_1 at equal bits; default: "
                             "bfloat16).")
    parser.add_argument("--rounds", type=int, default=3, help="Alternated rounds per load (default: 3).")
    parser.add_argument("--loads", default="0,1,2,taskset,quota",
                        help="Busy processes per case, comma-separated; 'taskset': no busy process, bestiary pinned "
                             "to one CPU; 'quota': in a cgroup with a 1-CPU quota (default: 0,1,2,taskset,quota).")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"Settings to run (default: {','.join(SETTINGS)}).")
    parser.add_argument("--workdir", default=None, help="Where the engine is built (default: a temporary dir).")
    args = parser.parse_args()
    print(f"uptime: {os.getloadavg()}  cpus: {len(os.sched_getaffinity(0))}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = engine(Path(args.workdir or tmp), args.dtype)
        settings = args.settings.split(",")
        for load in args.loads.split(","):
            if load == "quota" and quota_cgroup() is None:
                print("load quota: skipped (no cgroup v1 cpu controller this user may write)")
                continue
            readings: dict[str, list[float]] = {s: [] for s in settings}
            threads: dict[str, int] = {}
            procs = busy(int(load) if load.isdigit() else 0)
            try:
                time.sleep(0.5)
                for _ in range(args.rounds):
                    for s in settings:
                        r = run_case(engine_dir, s, load)
                        readings[s].append(r["rate"])
                        threads[s] = r["threads"]
            finally:
                for p in procs:
                    p.kill()
            medians = {s: statistics.median(v) for s, v in readings.items()}
            best = max(medians.values())
            for s in settings:
                print(f"load {load:8s} {s:10s} threads {threads[s]}  decode {medians[s]:6.1f} tok/s  "
                      f"({medians[s] / best:.2f}x best)  rounds {[round(x, 1) for x in readings[s]]}", flush=True)


if __name__ == "__main__":
    main()
