"""Soak test of `bestiary serve`: rounds of many concurrent streaming clients, some hanging up mid-stream.

Each round starts `--clients` streaming chat requests at once (max_tokens drawn from 8..--max_tokens,
ignore_eos, so each must end at exactly its max_tokens); a `--disconnect` fraction of them close
the connection after a few chunks. After each round it checks:

  - the server answers /health;
  - every stream that was read to the end is well-formed: status 200, every event `data: {json}`
    of one id, a role chunk first, exactly one finish_reason ("length"), a usage chunk whose
    completion_tokens equals the request's max_tokens, then `data: [DONE]`;
  - the KV blocks in use (GET /metrics) are back to 0 (waited for at most 30 s);
and at the end that the server's resident memory grew by less than 10% from round 1 to the last.

    python benchmarks/soak.py --engine_dir ENGINE [--clients 200] [--rounds 3] [--max_tokens 32]

Exit code 0 when every check holds. tests/serve/test_serve_soak.py runs it on a tiny engine (slow suite).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from bestiary.core.serve.process import ServerProcess


@dataclass
class RoundResult:
    round: int
    seconds: float
    completed: int = 0
    disconnected: int = 0
    malformed: list[str] = field(default_factory=list)
    kv_used_after: float = -1
    rss_mib: float = 0.0
    healthy: bool = False
    tokens: int = 0


def check_stream(lines: list[str], max_tokens: int) -> str | None:
    """None if the event lines of one finished stream are well-formed, else what is wrong."""
    events = [ln for ln in lines if ln]
    if not events or events[-1] != "data: [DONE]":
        return "no [DONE] at the end"
    try:
        chunks = [json.loads(ln.removeprefix("data: ")) for ln in events[:-1] if ln.startswith("data: ")]
    except ValueError as err:
        return f"an event is not JSON ({err})"
    if len(chunks) != len(events) - 1:
        return "an event line without 'data: '"
    if len({c["id"] for c in chunks}) != 1:
        return "chunks of several ids"
    if not chunks[0]["choices"] or chunks[0]["choices"][0]["delta"].get("role") != "assistant":
        return "no role chunk first"
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    if reasons != ["length"]:
        return f"finish reasons {reasons}"
    usage = chunks[-1].get("usage")
    if not usage or usage["completion_tokens"] != max_tokens:
        return f"usage {usage} for max_tokens {max_tokens}"
    return None


async def one_client(http: httpx.AsyncClient, url: str, model: str, rng: random.Random, max_tokens: int,
                     hang_up_after: int | None, result: RoundResult) -> None:
    n = rng.randint(8, max_tokens)
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about the number {rng.randint(0, 999)}."}],
            "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.8, "seed": rng.randint(0, 2**31)}
    lines: list[str] = []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            result.malformed.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            lines.append(line)
            if hang_up_after is not None and sum(1 for ln in lines if ln) >= hang_up_after:
                result.disconnected += 1
                return  # leaving the block closes the connection mid-stream
    problem = check_stream(lines, n)
    if problem:
        result.malformed.append(problem)
    else:
        result.completed += 1
        result.tokens += n


async def run_round(server: ServerProcess, model: str, index: int, args, rng: random.Random) -> RoundResult:
    result = RoundResult(index, 0.0)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        tasks = [one_client(http, server.url, model, rng, args.max_tokens,
                            rng.randint(2, 6) if rng.random() < args.disconnect else None, result)
                 for _ in range(args.clients)]
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=args.round_timeout)
    result.malformed += [f"client error: {o!r}" for o in outcomes if isinstance(o, BaseException)]
    result.seconds = time.perf_counter() - start
    result.healthy = server.healthy()
    deadline = time.monotonic() + 30
    result.kv_used_after = server.metric("bestiary_kv_blocks_used")
    while result.kv_used_after and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        result.kv_used_after = server.metric("bestiary_kv_blocks_used")
    result.rss_mib = server.rss_bytes() / 2**20
    return result


def soak(args) -> tuple[list[RoundResult], list[str]]:
    """Run the rounds; (results, failed checks)."""
    rng = random.Random(args.seed)
    flags = ["--max_queue_len", str(args.max_queue_len), "--served_model_name", "soak"]
    if args.num_threads:
        flags += ["--num_threads", str(args.num_threads)]
    results: list[RoundResult] = []
    with ServerProcess(args.engine_dir, *flags, log=args.log) as server:
        for i in range(1, args.rounds + 1):
            results.append(asyncio.run(run_round(server, "soak", i, args, rng)))
            r = results[-1]
            print(f"round {i}: {r.completed} complete + {r.disconnected} hung up of {args.clients} in {r.seconds:.1f} s "
                  f"({r.tokens / r.seconds:.0f} tokens/s), malformed {len(r.malformed)}, "
                  f"KV blocks in use after {r.kv_used_after:.0f}, RSS {r.rss_mib:.0f} MiB", file=sys.stderr)
    failures = []
    for r in results:
        if not r.healthy:
            failures.append(f"round {r.round}: /health failed")
        if r.malformed:
            failures.append(f"round {r.round}: {len(r.malformed)} malformed streams, e.g. {r.malformed[0]}")
        if r.completed + r.disconnected != args.clients:
            failures.append(f"round {r.round}: {r.completed + r.disconnected} of {args.clients} streams accounted for")
        if r.kv_used_after != 0:
            failures.append(f"round {r.round}: {r.kv_used_after:.0f} KV blocks still in use")
    growth = results[-1].rss_mib / results[0].rss_mib - 1 if results and results[0].rss_mib else 0.0
    if growth >= 0.10:
        failures.append(f"resident memory grew {growth:.1%} from round 1 to {len(results)} (limit 10%)")
    print(f"RSS growth round 1 -> {len(results)}: {growth:+.1%}", file=sys.stderr)
    return results, failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine_dir", required=True)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max_tokens", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.2, help="Fraction of clients that hang up mid-stream.")
    p.add_argument("--max_queue_len", type=int, default=256, help="Must exceed --clients (no 503 expected).")
    p.add_argument("--timeout", type=float, default=300.0, help="Per-request client timeout, seconds.")
    p.add_argument("--round_timeout", type=float, default=900.0)
    p.add_argument("--num_threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="Server log file.")
    args = p.parse_args(argv)
    if args.max_queue_len <= args.clients:
        p.error(f"--max_queue_len {args.max_queue_len} must exceed --clients {args.clients}")
    return args


def main(argv: list[str] | None = None) -> int:
    _, failures = soak(parse_args(argv))
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    print("soak: all checks hold" if not failures else f"soak: {len(failures)} checks failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
