"""Batch-1 decode per quantization mode on SmolLM2-135M-Instruct vs HF transformers fp32, same run.

HF runs the dense model (the GGUF dequantized once into an HF dir, core.bench.dense_hf), not
the GGUF itself (transformers 5 keeps that packed and dequantizes per matmul).
`bestiary bench --compare hf,llama.cpp,fastllm` measures the same decode beside every peer.

For each mode: convert the demo GGUF (fp32; quantized modes with bf16 activations, the "A16",
and round-to-nearest weights: speed is measured here, quality in tests/quant/test_quant_smollm2.py),
build, then measure decode tokens/s as (time for 1 + N tokens - time for 1) / N, greedy, EOS
ignored, median of --repeats runs alternating with HF fp32; engine size on disk; peak resident
memory of a fresh process loading the engine and generating; greedy agreement with the fp32 engine over
the held prompts (fraction of generated tokens equal before the first difference). If
llama-cpp-python is importable, llama.cpp on the same GGUF is measured too.

    python benchmarks/quant.py [--new_tokens 64] [--repeats 3] [--modes fp32 W8A16 W4A16_g64 ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT = "Write a short story about a robot who learns to paint."
HELD_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n"]


def modes() -> dict:
    """Mode name -> quantization section (None: fp32)."""
    from bestiary.core.format.config import QuantConfig

    return {
        "fp32": None,
        "W8A16": QuantConfig(quant_algo="W8A16"),
        "W4A16_g64": QuantConfig(quant_algo="W4A16", group_size=64),
        "W4A16_g128_zp": QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=True),
        "W8A16+INT8_KV": QuantConfig(quant_algo="W8A16", kv_cache_quant_algo="INT8"),
        "W8A16+FP8_KV": QuantConfig(quant_algo="W8A16", kv_cache_quant_algo="FP8"),
    }


# VmHWM (peak RSS of this process image, in kB), not getrusage's ru_maxrss: Linux keeps
# ru_maxrss across fork + exec, so a child reported the benchmark's own (large) RSS.
PEAK_RSS_SCRIPT = """
import sys
from pathlib import Path
from bestiary import LLM, SamplingConfig
llm = LLM(sys.argv[1])
llm.generate([[int(t) for t in sys.argv[2].split(",")]], SamplingConfig(max_new_tokens=16, temperature=0.0))
print(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0])
"""


def peak_rss_mib(engine: Path, ids: list[int]) -> float:
    """Peak resident memory (MiB) of a fresh process that loads `engine` and generates 16 tokens
    (python + torch + the engine: the whole footprint a user sees)."""
    out = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(engine), ",".join(map(str, ids))],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def ours_seconds(llm, ids: list[int], n: int) -> float:
    from bestiary.core.runtime.sampling import SamplingConfig

    t0 = time.perf_counter()
    llm.generate([ids], SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def hf_seconds(model, ids: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t0


def decode_rate(run, n: int) -> float:
    """Tokens/s of the decode phase: N extra tokens over the time they added."""
    first = run(1)
    return n / (run(1 + n) - first)


def greedy_ids(llm, tokenizer, n: int) -> list[list[int]]:
    from bestiary.core.runtime.sampling import SamplingConfig

    # One prompt at a time: a batch of 4 here crashed inside aten._weight_int8pack_mm twice
    # (lm_head, bf16, 4 rows) in a process that also holds the HF model; not reproduced alone.
    sampling = SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [llm.generate([tokenizer(p).input_ids], sampling)[0].output_ids for p in HELD_PROMPTS]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Mean over prompts of (tokens equal before the first difference) / tokens."""
    fractions = []
    for a, b in zip(ours, ref):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fractions.append(same / max(1, len(b)))
    return sum(fractions) / len(fractions)


def llama_cpp_seconds(gguf: Path, ids: list[int]):
    """A function k -> seconds llama.cpp takes to generate k tokens after `ids` (greedy) on the GGUF,
    or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = torch.get_num_threads()  # prompt batches too: llama.cpp would take every core for those
    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(k: int) -> float:
        llm.reset()
        t0 = time.perf_counter()
        for i, _ in enumerate(llm.generate(ids, temp=0.0)):
            if i + 1 >= k:
                break
        return time.perf_counter() - t0

    return run


def llama_cpp_rate(gguf: Path, ids: list[int], n: int, repeats: int) -> float | None:
    """llama.cpp batch-1 decode tokens/s on the GGUF, or None without llama-cpp-python."""
    run = llama_cpp_seconds(gguf, ids)
    if run is None:
        return None
    run(4)
    return statistics.median(decode_rate(run, n) for _ in range(repeats))


def main() -> None:
    import transformers

    from bestiary.core.bench.dense_hf import dense_hf_dir
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.llm import LLM

    all_modes = modes()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--agreement_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(all_modes), choices=list(all_modes))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = demo_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = tokenizer(PROMPT).input_ids
    # the dense model a transformers user runs (transformers keeps a GGUF packed: core.bench.dense_hf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dense_hf_dir(gguf)), dtype=torch.float32).eval()
    def hf_run(n: int) -> float:
        return hf_seconds(hf, torch.tensor([ids]), n)

    hf_run(4)
    rows, hf_rates, reference = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ["fp32"] + [m for m in args.modes if m != "fp32"]:
            ckpt, engine = Path(tmp) / f"{mode}-ckpt", Path(tmp) / f"{mode}-engine"
            # Weight-only modes run 16-bit activations (the "A16"); RTN: speed, not quality, is measured here
            dtype = "float32" if mode == "fp32" else "bfloat16"
            convert(gguf, ckpt, ConvertOptions(dtype=dtype, quantization=all_modes[mode],
                                               weight_quantizer=None if mode == "fp32" else "rtn"),
                    show_progress=False)
            build_engine(ckpt, engine, BuildConfig(max_batch_size=4, max_seq_len=512))
            rss = peak_rss_mib(engine, ids)
            llm = LLM(engine)
            run = functools.partial(ours_seconds, llm, ids)
            run(4)
            rates = []
            for _ in range(args.repeats):
                rates.append(decode_rate(run, args.new_tokens))
                hf_rates.append(decode_rate(hf_run, args.new_tokens))
            held = greedy_ids(llm, tokenizer, args.agreement_tokens)
            reference = held if mode == "fp32" else reference
            if mode in args.modes:
                rows.append((mode, statistics.median(rates), dir_mib(engine), rss, agreement(held, reference)))
            del llm
            gc.collect()
    hf_rate = statistics.median(hf_rates)
    cpp = llama_cpp_rate(gguf, ids, args.new_tokens, args.repeats)
    print(f"SmolLM2-135M-Instruct, batch 1, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}; HF fp32 {hf_rate:.1f} tok/s"
          + (f"; llama.cpp (GGUF Q4_1) {cpp:.1f} tok/s" if cpp else "; llama.cpp: llama-cpp-python not installed"))
    print(f"{'mode':<16} {'tok/s':>7} {'vs HF fp32':>10} {'vs llama.cpp':>12} {'engine MiB':>10} {'peak RSS MiB':>12} "
          f"{'greedy agree':>12}")
    for mode, rate, size, rss, agree in rows:
        vs_cpp = f"{rate / cpp:.2f}x" if cpp else "-"
        print(f"{mode:<16} {rate:>7.1f} {rate / hf_rate:>9.2f}x {vs_cpp:>12} {size:>10.1f} {rss:>12.1f} {agree:>12.2f}")


if __name__ == "__main__":
    main()
