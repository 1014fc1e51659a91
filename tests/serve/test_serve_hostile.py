"""`bestiary serve` (a subprocess on 127.0.0.1, tiny chat engine) against hostile clients: hundreds of
invalid bodies from a seed (tests/helpers/hostile_bodies.py), each answered 4xx with the server healthy
and nothing held after it, memory flat; a 20 MB body refused at once while a stream keeps flowing; a
client hanging up on a non-streamed request leaves no traceback in the log. Loopback only, bounded in
count and time."""

from __future__ import annotations

import collections
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from hostile_bodies import hostile_bodies  # noqa: E402
from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.serve.process import ServerProcess  # noqa: E402

MODEL = "tiny"
CHAT = "/v1/chat/completions"
VALID = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
GAUGES = ("bestiary_requests_waiting", "bestiary_requests_running", "bestiary_kv_blocks_used")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = make_tiny_chat_engine(tmp_path_factory.mktemp("hostile"))
    log = tmp_path_factory.mktemp("hostile-log") / "server.log"
    with ServerProcess(engine, "--served_model_name", MODEL, log=log) as s:
        s.log_path = log
        yield s


def post(http, server, path: str, raw: bytes):
    return http.post(f"{server.url}{path}", content=raw, headers={"Content-Type": "application/json"})


def held(server) -> dict[str, float]:
    """The gauges of what requests hold, once a cancel had a step to land (at most 5 s)."""
    deadline = time.monotonic() + 5.0
    while True:
        values = {g: server.metric(g) for g in GAUGES}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_hundreds_of_hostile_bodies_are_4xx_and_the_server_stays_whole(server):
    with httpx.Client(timeout=30.0) as http:
        for _, path, raw in hostile_bodies(seed=470, count=30):  # warm-up: every code path once
            post(http, server, path, raw)
        for _ in range(3):
            assert post(http, server, CHAT, json.dumps(VALID).encode()).status_code == 200
        rss_warm = server.rss_bytes()
        kinds: collections.Counter[str] = collections.Counter()
        for i, (kind, path, raw) in enumerate(hostile_bodies(seed=47, count=320)):
            reply = post(http, server, path, raw)
            assert 400 <= reply.status_code < 500, (kind, raw[:300], reply.status_code, reply.text[:300])
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
            assert "\n" not in reply.json()["error"]["message"], reply.text  # one line
            kinds[kind] += 1
            if i % 40 == 0:
                assert server.healthy() and not any(held(server).values()), (i, kind)
        assert not any(held(server).values())
        assert post(http, server, CHAT, json.dumps(VALID).encode()).status_code == 200
        rss_after = server.rss_bytes()
    print(f"\nhostile bodies by kind: {dict(sorted(kinds.items()))}; RSS warm {rss_warm / 2**20:.0f} MiB, "
          f"after {rss_after / 2**20:.0f} MiB")
    assert rss_after <= 1.05 * rss_warm + 64 * 2**20
    assert "Traceback" not in server.log_path.read_text()


def stream_arrivals(server, arrivals: list[float], done: threading.Event) -> None:
    """A streamed completion of 200 tokens; the time each event arrives."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True,
            "logprobs": 5}
    with httpx.Client(timeout=60.0) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter())
    done.set()


def test_a_20_mb_body_is_refused_at_once_while_a_stream_keeps_flowing(server):
    """Before: 71-73 s to refuse, the whole server frozen meanwhile (/health and streams stalled)."""
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * (4 * 2**20)}]}).encode()
    arrivals: list[float] = []
    done = threading.Event()
    streaming = threading.Thread(target=stream_arrivals, args=(server, arrivals, done), daemon=True)
    streaming.start()
    while len(arrivals) < 5 and not done.is_set():
        time.sleep(0.005)
    refusals = []
    with httpx.Client(timeout=30.0) as http:
        for content in (big, (big[i:i + 2**16] for i in range(0, len(big), 2**16))):  # declared, then chunked
            start = time.perf_counter()
            reply = http.post(f"{server.url}{CHAT}", content=content, headers={"Content-Type": "application/json"})
            refusals.append((start, time.perf_counter()))
            assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large", reply.text
    streaming.join(timeout=60)
    assert done.is_set() and len(arrivals) > 100
    window = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= refusals[0][0] and a <= refusals[-1][1]]
    print(f"\n20 MB refused in {refusals[0][1] - refusals[0][0]:.3f} s (declared), "
          f"{refusals[1][1] - refusals[1][0]:.3f} s (chunked); largest inter-token gap meanwhile "
          f"{max(window, default=0.0):.3f} s; median gap {sorted(b - a for a, b in zip(arrivals, arrivals[1:]))[100]:.4f} s")
    assert all(end - start < 1.0 for start, end in refusals)
    assert max(window, default=0.0) < 1.0


def test_a_client_hanging_up_on_a_json_request_cancels_it_without_a_traceback(server):
    """Before: every such hang-up logged an ASGI traceback ("aclose(): asynchronous generator is already running")."""
    before = server.log_path.read_text()
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "n": 4}).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)  # generating
        assert not any(held(server).values())
    assert server.healthy()
    new = server.log_path.read_text()[len(before):]
    assert "Traceback" not in new and "aclose" not in new, new[-2000:]
