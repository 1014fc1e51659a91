"""`bestiary serve` in a subprocess on a free port of 127.0.0.1 (tests and benchmarks drive it over HTTP)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TextIO

from bestiary.core.format.errors import BestiaryError


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(engine_dir, "--api_key", "k") as server:` ... server.url ... (stopped at exit).

    Waits for GET /health (at most `start_timeout` seconds); stderr goes to `log` (a file path).
    """

    def __init__(self, engine_dir: str | Path, *flags: str, log: str | Path | None = None,
                 start_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "bestiary", "serve", "--engine_dir", str(engine_dir),
                    "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.log = Path(log) if log else None
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: TextIO | None = None

    def __enter__(self) -> ServerProcess:
        self._out = open(self.log, "w") if self.log else None  # closed in __exit__
        out = self._out or subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=out)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BestiaryError(f"bestiary serve exited with code {self.proc.returncode} "
                                    f"({self.log or 'no log'}): {' '.join(self.cmd)}")
            if self.healthy():
                return self
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise BestiaryError(f"bestiary serve did not answer /health within {self.start_timeout:.0f} s")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric from GET /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def wait_for_kv_blocks_free(self, seconds: float = 10.0) -> float:
        """bestiary_kv_blocks_used once it is 0, or its value after `seconds` (cancels free blocks a step later)."""
        deadline = time.monotonic() + seconds
        used = self.metric("bestiary_kv_blocks_used")
        while used and time.monotonic() < deadline:
            time.sleep(0.05)
            used = self.metric("bestiary_kv_blocks_used")
        return used

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux /proc)."""
        if self.proc is None:
            raise BestiaryError("the server is not running: use ServerProcess in a `with` block")
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._out is not None:
            self._out.close()
