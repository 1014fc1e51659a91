"""Performance on a CUDA device: bestiary against transformers (eager) and the machine's own limits.

    python benchmarks/gpu_perf.py OUT.json [--new-tokens 128] [--prefill 4096] [--small]

All in one process, one model: a LLaMA of TinyLlama-1.1B's shape (hidden 2048, FFN 5632, 22 layers,
32 heads over 4 KV heads, vocabulary 32000) with random bf16 weights made on the device (transformers'
initialisation), saved once and converted by bestiary (bf16, W8A16 and W4A16 group 128 with RTN).

    limits         device-to-device copy GB/s (bytes read + written), bf16 8192^3 matmul TFLOP/s
    hf             transformers eager generate, bf16: batch 1 and batch 64 decode tok/s
    bf16_b1        bestiary LLM.generate batch 1: decode tok/s, % of the copy bandwidth (bytes each
                   token reads: every weight but the embedding table, plus the KV read), x transformers
    bf16_step      one decode step of the model alone (CUDA graph replay or eager), ms
    bf16_b64       batch 64 decode tok/s, x transformers
    prefill        one 4,096-token prompt through the model: TFLOP/s (2 per weight per token + causal
                   attention 2 * 2 * T^2 / 2 * hidden per layer) and % of the measured matmul rate
    w8a16 / w4a16  batch-1 decode tok/s and % of the copy bandwidth at their bytes

Results go to OUT.json after each part (a hang loses only the part in flight). --small shrinks the
model to 2 layers and the sizes below for a CPU dry run of the code paths.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False)
SMALL = TINYLLAMA | dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
PROMPT_LEN = 16


class Results:
    """The parts measured so far, rewritten to `path` as each one ends."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def part(self, name: str, fn: Callable[[], dict]) -> dict | None:
        start = time.perf_counter()
        try:
            row = fn()
        except Exception as err:  # one broken part does not hide the others
            traceback.print_exc()
            row = {"error": f"{type(err).__name__}: {err}"[:2000]}
        row["seconds"] = round(time.perf_counter() - start, 2)
        self.data[name] = row
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"{name:10s} {json.dumps(row)[:400]}", flush=True)
        return None if "error" in row else row


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], reps: int = 1) -> float:
    """Median wall seconds of fn() over reps, the device synchronized around each."""
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def limits(device: str, small: bool) -> dict:
    """The copy bandwidth (read + write) of 1 GiB buffers and the bf16 matmul rate on random data."""
    n = (1 << 24) if small else (1 << 30)
    a = torch.randn(n // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    copy_s = timed(lambda: b.copy_(a), 10)
    m = 512 if small else 8192
    x, y = torch.randn(m, m, device=device, dtype=torch.bfloat16), torch.randn(m, m, device=device, dtype=torch.bfloat16)
    x @ y
    mm_s = timed(lambda: x @ y, 10)
    return {"copy_gbps": 2 * n / copy_s / 1e9, "matmul_tflops": 2 * m ** 3 / mm_s / 1e12,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else device}


def make_source(config: dict, device: str, root: Path):
    """A random bf16 transformers LLaMA on `device` and its saved directory."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(root / "source")
    return model, root / "source"


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(10, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def hf_decode(model, batch: int, new_tokens: int, vocab: int) -> float:
    """transformers eager generate (greedy, fixed length): decode tok/s after the first token."""
    ids = torch.tensor(prompts(batch, vocab), device=model.device)

    def run(n: int):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)

    run(4)
    first, total = timed(lambda: run(1)), timed(lambda: run(new_tokens))
    if total <= first:  # a busy machine slowed the one-token run: the whole run's rate instead
        return batch * new_tokens / total
    return batch * (new_tokens - 1) / (total - first)


def engine_dir(source: Path, root: Path, name: str, batch: int, max_len: int, **convert_args) -> Path:
    """Convert `source` (keyword arguments: ConvertOptions fields) and build an engine for `batch` x `max_len`
    tokens."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    ckpt = convert(source, root / f"{name}_ckpt", ConvertOptions(**convert_args), show_progress=False)
    build = BuildConfig(max_batch_size=batch, max_seq_len=max_len + 1, max_input_len=max_len, max_num_tokens=max(max_len, batch))
    return build_engine(ckpt, root / f"{name}_engine", build)


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the model's tensors: all of them but the token embedding table."""
    skip = {id(model.transformer.vocab_embedding.weight)} if not model.shares_embedding else set()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes_per_token(model, context: int) -> int:
    """K and V bytes one decode token reads at `context` cached tokens."""
    c = model.config
    kvh = c.num_key_value_heads or c.num_attention_heads
    return 2 * c.num_hidden_layers * kvh * c.head_size * context * model.dtype.itemsize


def llm_decode(llm, batch: int, new_tokens: int) -> dict:
    """LLM.generate of `batch` prompts, greedy: decode tok/s after the first token, and the graph state."""
    from bestiary.core.runtime.sampling import SamplingConfig

    vocab = llm.engine.model.config.vocab_size
    ps = prompts(batch, vocab)

    def run(n: int):
        llm.generate(ps, SamplingConfig(temperature=0, max_new_tokens=n, ignore_eos=True))

    run(4)  # compiles the kernels and captures this batch size's graph
    run(new_tokens)
    stats = llm.last_stats  # one run's own clock: a separate first-token run timed apart could take longer
    first = stats.first_token_seconds or 0.0  # than the whole run on a busy machine (a negative rate, CI 11-29)
    model = llm.engine.model
    return {"tok_s": batch * (new_tokens - 1) / max(stats.seconds - first, 1e-9), "ttft_ms": first * 1e3,
            "graphs": len(model.__dict__.get("_cuda_graphs", {})), "graph_refusal": model.__dict__.get("cuda_graph_refusal")}


def decode_step_ms(llm, context: int, reps: int = 50) -> dict:
    """One batch-1 decode step of the model alone (graph replay where it runs), graph and eager."""
    from bestiary.core.kernels.metadata import AttentionMetadata

    model, kv = llm.engine.model, llm.executor.kv
    device = kv.k.device
    blocks = list(range(-(-(context + 1) // kv.k.shape[2])))
    meta = AttentionMetadata.build([1], [context], [blocks], kv.k.shape[2], device=device)
    ids = torch.tensor([5], device=device)
    with torch.inference_mode():
        model(ids, meta, kv)
        graph = timed(lambda: model(ids, meta, kv), reps)
        meta = AttentionMetadata.build([1], [context], [blocks], kv.k.shape[2], device=device)
        model.eager_forward(ids, meta, kv)
        eager = timed(lambda: model.eager_forward(ids, meta, kv), reps)
        out_g = model(ids, AttentionMetadata.build([1], [context], [blocks], kv.k.shape[2], device=device), kv)
        out_e = model.eager_forward(ids, AttentionMetadata.build([1], [context], [blocks], kv.k.shape[2], device=device), kv)
    return {"step_ms": graph * 1e3, "eager_step_ms": eager * 1e3,
            "graph_vs_eager_max_diff": (out_g.float() - out_e.float()).abs().max().item()}


def prefill(llm, tokens: int, matmul_tflops: float) -> dict:
    """One `tokens`-long prompt through the model (last-token logits): ms, TFLOP/s, % of the matmul rate."""
    from bestiary.core.kernels.metadata import AttentionMetadata

    model, kv = llm.engine.model, llm.executor.kv
    device, bs = kv.k.device, kv.k.shape[2]
    meta = AttentionMetadata.build([tokens], [0], [list(range(-(-tokens // bs)))], bs, device=device)
    ids = torch.randint(10, model.config.vocab_size, (tokens,), device=device)
    with torch.inference_mode():
        model(ids, meta, kv)
        s = timed(lambda: model(ids, meta, kv), 3)
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "vocab_embedding" not in n and "lm_head" not in n)
    flops = 2 * params * tokens + 2 * c.hidden_size * c.vocab_size + c.num_hidden_layers * 2 * tokens ** 2 * c.hidden_size
    tflops = flops / s / 1e12
    return {"ms": s * 1e3, "tflops": tflops, "pct_matmul": 100 * tflops / matmul_tflops}


def bandwidth_row(row: dict, model, context: int, copy_gbps: float, hf_tok_s: float | None = None) -> dict:
    """Add the bytes a token reads, the share of the copy bandwidth and the ratio to transformers."""
    per_token = weight_bytes(model) + kv_bytes_per_token(model, context)
    row |= {"bytes_per_token": per_token, "limit_tok_s": copy_gbps * 1e9 / per_token,
            "pct_bandwidth": 100 * row["tok_s"] * per_token / (copy_gbps * 1e9)}
    if hf_tok_s:
        row["x_transformers"] = row["tok_s"] / hf_tok_s
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file the results are written to (rewritten after each part)")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request (default 128)")
    parser.add_argument("--prefill", type=int, default=4096, help="prompt length of the prefill part (default 4096)")
    parser.add_argument("--batch", type=int, default=64, help="batch of the batched decode part (default 64)")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--small", action="store_true", help="a 2-layer toy model and small sizes (CPU dry run)")
    args = parser.parse_args()
    from bestiary.core.runtime.llm import LLM

    res = Results(args.out)
    config = SMALL if args.small else TINYLLAMA
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 16 << 30 else None
    root = Path(tempfile.mkdtemp(prefix="bestiary-gpu-perf-", dir=base))
    try:
        lim = res.part("limits", lambda: limits(args.device, args.small)) or {"copy_gbps": float("nan"),
                                                                              "matmul_tflops": float("nan")}
        made: dict = {}
        res.part("source", lambda: made.update(zip(("hf", "src"), make_source(config, args.device, root))) or {
            "params": sum(p.numel() for p in made["hf"].parameters())})
        if "hf" not in made:
            return 1
        hf = {}
        res.part("hf", lambda: hf.update(b1=hf_decode(made["hf"], 1, args.new_tokens, config["vocab_size"]),
                                         b64=hf_decode(made["hf"], args.batch, args.new_tokens, config["vocab_size"]))
                 or dict(hf))
        made["hf"].to("cpu")
        del made["hf"]
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        longest = max(args.prefill, PROMPT_LEN + args.new_tokens)
        eng = engine_dir(made["src"], root, "bf16", args.batch, longest, dtype="bfloat16")
        llm = LLM(eng, device=args.device)
        context = PROMPT_LEN + args.new_tokens // 2
        res.part("bf16_b1", lambda: bandwidth_row(llm_decode(llm, 1, args.new_tokens), llm.engine.model, context,
                                                  lim["copy_gbps"], hf.get("b1")))
        res.part("bf16_step", lambda: decode_step_ms(llm, context))
        res.part("bf16_b64", lambda: (lambda r: r | {"x_transformers": r["tok_s"] / hf["b64"]} if hf.get("b64") else r)(
            llm_decode(llm, args.batch, args.new_tokens)))
        res.part("prefill", lambda: prefill(llm, args.prefill, lim["matmul_tflops"]))
        llm.close()
        llm = None  # the bf16 engine's memory, free before the quantized ones load
        from bestiary.core.format.config import QuantConfig

        for name, quant in (("w8a16", QuantConfig(quant_algo="W8A16")),
                            ("w4a16", QuantConfig(quant_algo="W4A16", group_size=128))):
            def run(name=name, quant=quant) -> dict:
                path = engine_dir(made["src"], root, name, 1, PROMPT_LEN + args.new_tokens, dtype="bfloat16",
                                  quantization=quant, weight_quantizer="rtn", tune_steps=0)
                q = LLM(path, device=args.device)
                try:
                    return bandwidth_row(llm_decode(q, 1, args.new_tokens), q.engine.model, context, lim["copy_gbps"],
                                         hf.get("b1"))
                finally:
                    q.close()

            res.part(name, run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        summary(res.data)
    return 1 if any("error" in row for row in res.data.values()) else 0


def summary(data: dict) -> None:
    """The closing table (the device run's output tail carries it)."""
    def get(part: str, key: str, fmt: str = "{:.1f}") -> str:
        v = data.get(part, {}).get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else str(v)

    print("\n| what | value |\n|---|---|")
    rows = [("copy GB/s (read+write)", get("limits", "copy_gbps")), ("bf16 matmul TFLOP/s", get("limits", "matmul_tflops")),
            ("transformers b1 / b64 tok/s", f"{get('hf', 'b1')} / {get('hf', 'b64')}"),
            ("bf16 b1 tok/s, % bw, x HF", f"{get('bf16_b1', 'tok_s')}, {get('bf16_b1', 'pct_bandwidth')}%, "
                                          f"{get('bf16_b1', 'x_transformers', '{:.2f}')}x"),
            ("bf16 step ms graph / eager", f"{get('bf16_step', 'step_ms', '{:.3f}')} / {get('bf16_step', 'eager_step_ms', '{:.3f}')}"),
            ("bf16 b64 tok/s, x HF", f"{get('bf16_b64', 'tok_s')}, {get('bf16_b64', 'x_transformers', '{:.2f}')}x"),
            ("prefill ms, TFLOP/s, % matmul", f"{get('prefill', 'ms')}, {get('prefill', 'tflops')}, {get('prefill', 'pct_matmul')}%"),
            ("W8A16 b1 tok/s, % bw", f"{get('w8a16', 'tok_s')}, {get('w8a16', 'pct_bandwidth')}%"),
            ("W4A16 b1 tok/s, % bw", f"{get('w4a16', 'tok_s')}, {get('w4a16', 'pct_bandwidth')}%")]
    for k, v in rows:
        print(f"| {k} | {v} |")
    errors = {k: v["error"][:200] for k, v in data.items() if "error" in v}
    if errors:
        print("errors:", json.dumps(errors, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
