"""The fuzz worker: a long-lived process that imports bestiary once and runs one case per request.

    python tests/fuzz/fuzz_worker.py ROOT REQUEST_FD REPLY_FD AS_LIMIT_BYTES

Requests are JSON lines on REQUEST_FD (the process's own stdin is /dev/null: a case that reads fd 0
cannot eat the requests): {"argv": [...], "cwd": DIR, "stdin": TEXT, "env": {...}}. Each is
run as `bestiary.core.cli.main.main(argv)` in this process with file descriptors 1 and 2 redirected
to files (so C libraries' output and warnings are caught too) and sys.stdin a StringIO of TEXT; the
reply, one JSON line on REPLY_FD, holds the exit code, stdout's tail, stderr and the seconds taken.
argparse's SystemExit gives its code; anything escaping main() is printed as the traceback a real
process would print (exit 1). Per case, the warnings registries are cleared (a warning shows in
every case that causes it, as in a fresh process) and torch's thread count, the working directory
and the environment are restored. Before the first request the worker builds ROOT/base (fuzz_base)
if needed, warms the CPU kernels, then limits its address space (RLIMIT_AS) to what it uses plus
AS_LIMIT_BYTES and says {"ready": ...}.
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

STDOUT_TAIL = 4000
STDERR_CAP = 20000


def _vsz() -> int:
    """This process's virtual memory size in bytes (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _clear_warning_registries() -> None:
    """Forget which warnings were shown, so each case shows its own (a fresh process would)."""
    for module in list(sys.modules.values()):
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()


def _call_main(argv: list[str]) -> int:
    """main(argv) as the `bestiary` script would end: its code, SystemExit's, or 1 after a traceback."""
    from bestiary.core.cli.main import main

    try:
        return int(main(argv) or 0)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            return int(err.code or 0)
        print(err.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what escapes main() is what a real process prints
        traceback.print_exc()
        return 1


def run_case(request: dict) -> dict:
    """Run one request with fds 1 and 2 captured; the reply dict."""
    import torch

    threads, cwd, env = torch.get_num_threads(), os.getcwd(), dict(os.environ)
    os.environ.update(request.get("env", {}))
    _clear_warning_registries()
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdin = io.StringIO(request.get("stdin", ""))
    start = time.perf_counter()
    try:
        os.chdir(request["cwd"])
        code = _call_main(request["argv"])
    finally:
        seconds = time.perf_counter() - start
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    return {"code": code, "stdout": _read(out)[-STDOUT_TAIL:], "stderr": _read(err)[:STDERR_CAP],
            "seconds": round(seconds, 3)}


def _read(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


def warm_up(root: Path) -> None:
    """ROOT/base built, bestiary imported, the CPU kernels loaded (copied from the user's cache if
    built there, else compiled once into the fuzz cache), one tiny generation done."""
    import shutil

    import fuzz_base
    import torch

    from bestiary.core.format.cache import cache_dir

    torch.set_num_threads(1)
    base = fuzz_base.build_base(root)
    own = Path(os.environ.get("BESTIARY_CACHE", ""))
    user = Path(os.environ.get("FUZZ_USER_CACHE", ""))
    if own and not (own / "cpu-kernels").exists() and (user / "cpu-kernels").is_dir():
        shutil.copytree(user / "cpu-kernels", own / "cpu-kernels")
    assert cache_dir() == own
    from bestiary.core.cli.main import main

    if main(["run", "--engine_dir", str(base / "engine"), "--input_ids", "1,2", "--max_output_len", "2"]) != 0:
        raise RuntimeError("the tiny engine does not run")
    main(["list"])  # every command module and the registry imported


def serve_stub() -> None:
    """`bestiary serve` returns instead of serving: uvicorn.run is replaced (the fuzz checks what comes
    before it: flags, engine, chat template, adapters)."""
    try:
        import uvicorn
    except ImportError:
        return
    uvicorn.run = lambda *args, **kwargs: None


def main() -> None:
    """Warm up, limit memory, then answer requests until the request pipe closes."""
    root, request_fd, reply_fd, extra = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
    # a hang's stacks, into the log (Worker.run): fd 2 as started, before run_case points fd 2 at each case's file
    faulthandler.register(signal.SIGUSR1, file=os.fdopen(os.dup(2), "w"), all_threads=True)
    warm_up(root)
    serve_stub()
    limit = _vsz() + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    reply = os.fdopen(reply_fd, "w", buffering=1)
    reply.write(json.dumps({"ready": True, "as_limit": limit}) + "\n")
    for line in os.fdopen(request_fd, "r"):
        reply.write(json.dumps(run_case(json.loads(line))) + "\n")


if __name__ == "__main__":
    main()
