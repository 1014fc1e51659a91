"""HTTP serving benchmark: `bestiary serve` (SmolLM2-135M-Instruct, bf16) under 1, 8 and 32 concurrent
streaming clients, against the in-process asyncio API (LLM.generate_async) on the same engine.

Closed loop: each client sends `--requests_per_client` streaming /v1/completions requests one after
another (prompts from a fixed list, max_tokens --max_tokens, greedy, ignore_eos, so every request
generates exactly that many tokens). Reported per level: throughput (generated tokens / wall time),
p50 / p99 time to first token (request sent -> first non-empty text chunk... first chunk with a token)
and p50 / p99 inter-token latency (between consecutive chunks of one stream, each chunk one step).
The in-process run does the same with `--inprocess_clients` asyncio tasks calling generate_async;
HTTP overhead = 1 - HTTP throughput / in-process throughput at that client count.

The client runs on the same machine as the server: its JSON / SSE parsing takes CPU from the server
(part of the measured overhead). Report `uptime` with the figures on a shared machine.

    python benchmarks/serving_http.py [--levels 1 8 32] [--max_tokens 64] [--requests_per_client 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "To make a cup of tea, first", "The largest planet in the solar system",
    "In machine learning, overfitting means", "A haiku about the sea:",
]


@dataclass
class Run:
    name: str
    clients: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def http_level(url: str, clients: int, per_client: int, max_tokens: int) -> Run:
    import httpx

    run = Run("HTTP", clients)
    limits = httpx.Limits(max_connections=clients + 4)

    async def client(c: int, http: httpx.AsyncClient) -> None:
        for r in range(per_client):
            body = {"model": "smol", "prompt": PROMPTS[(c + r) % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            sent = time.perf_counter()
            last = None
            async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    json.loads(line[6:])
                    if last is None:
                        run.ttft.append(now - sent)
                    else:
                        run.itl.append(now - last)
                    last = now
            run.tokens += max_tokens

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        run.seconds = time.perf_counter() - start
    return run


async def inprocess_level(llm, clients: int, per_client: int, max_tokens: int) -> Run:
    from bestiary.core.runtime.sampling import SamplingConfig

    run = Run("in-process", clients)
    sampling = SamplingConfig(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def client(c: int) -> None:
        for r in range(per_client):
            sent, last = time.perf_counter(), None
            async for delta in llm.generate_async(PROMPTS[(c + r) % len(PROMPTS)], sampling):
                now = time.perf_counter()
                if last is None:
                    run.ttft.append(now - sent)
                else:
                    run.itl.append(now - last)
                last = now
                run.tokens += len(delta.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    run.seconds = time.perf_counter() - start
    return run


def smollm2_engine(workdir: Path, dtype: str) -> Path:
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    engine = workdir / f"smollm2-{dtype}-serve-engine"
    if not (engine / "config.json").is_file():
        convert(demo_model_path(), workdir / f"smollm2-{dtype}-ckpt", ConvertOptions(dtype=dtype), show_progress=False)
        build_engine(workdir / f"smollm2-{dtype}-ckpt", engine, BuildConfig(max_batch_size=32, max_seq_len=512))
    return engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--inprocess_clients", type=int, nargs="+", default=[8])
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--requests_per_client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="Alternated HTTP / in-process pairs per client count.")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "bestiary-bench"))
    p.add_argument("--engine_dir", default=None, help="Use this engine instead of building SmolLM2.")
    p.add_argument("--json", default=None, help="Also write the figures here.")
    args = p.parse_args(argv)

    from bestiary.core.runtime.llm import LLM
    from bestiary.core.serve.process import ServerProcess

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    engine = Path(args.engine_dir) if args.engine_dir else smollm2_engine(workdir, args.dtype)
    print(f"uptime before: {os.popen('uptime').read().strip()}", file=sys.stderr)
    runs: list[Run] = []
    pairs: list[tuple[Run, Run]] = []  # (HTTP, in-process) at the same client count, run back to back
    llm = LLM(engine)
    try:
        with ServerProcess(engine, "--served_model_name", "smol", log=workdir / "serving_http.log") as server:
            asyncio.run(http_level(server.url, 1, 1, 8))  # warm-up
            asyncio.run(inprocess_level(llm, 1, 1, 8))
            for clients in args.levels:
                runs.append(asyncio.run(http_level(server.url, clients, args.requests_per_client, args.max_tokens)))
                print(f"HTTP {clients}: {runs[-1].throughput:.1f} tokens/s", file=sys.stderr)
            for clients in args.inprocess_clients:
                for _ in range(args.repeats):  # alternated, so both see the same machine load
                    http = asyncio.run(http_level(server.url, clients, args.requests_per_client, args.max_tokens))
                    inproc = asyncio.run(inprocess_level(llm, clients, args.requests_per_client, args.max_tokens))
                    pairs.append((http, inproc))
                    print(f"{clients} clients: HTTP {http.throughput:.1f}, in-process {inproc.throughput:.1f} tokens/s",
                          file=sys.stderr)
                runs.append(next(r for _, r in sorted(((r.throughput, r) for h, r in pairs if r.clients == clients),
                                                      key=lambda t: t[0])[len(pairs) // 2 :]))
    finally:
        llm.close()
    print(f"uptime after: {os.popen('uptime').read().strip()}", file=sys.stderr)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"SmolLM2-135M-Instruct {args.dtype}: {args.max_tokens} tokens per request, "
                        f"{args.requests_per_client} requests per client")
    for col in ("path", "clients", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in runs:
        table.add_row(r.name, str(r.clients), f"{r.throughput:.1f}", f"{pct(r.ttft, 50) * 1e3:.0f}",
                      f"{pct(r.ttft, 99) * 1e3:.0f}", f"{pct(r.itl, 50) * 1e3:.1f}", f"{pct(r.itl, 99) * 1e3:.1f}")
    Console(width=160).print(table)
    for clients in args.inprocess_clients:
        mine = [(h, r) for h, r in pairs if r.clients == clients]
        ratios = sorted(h.throughput / r.throughput for h, r in mine)
        print(f"{clients} clients, {len(mine)} alternated pairs: HTTP / in-process throughput "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; median overhead {1 - statistics.median(ratios):+.1%} "
              f"(target <= 10%); TTFT p50 {statistics.median([t for h, _ in mine for t in h.ttft]) * 1e3:.0f} vs "
              f"{statistics.median([t for _, r in mine for t in r.ttft]) * 1e3:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "path": r.name, "clients": r.clients, "tokens_per_s": r.throughput, "ttft_p50": pct(r.ttft, 50),
            "ttft_p99": pct(r.ttft, 99), "itl_p50": pct(r.itl, 50), "itl_p99": pct(r.itl, 99)} for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
