"""Ctrl-C (SIGINT) and SIGTERM: remembered, and checked wherever an output is committed.

The `bestiary` script installs `on_signal` as the first thing it does (core.cli's entry), before
any heavy import. From then on a signal is remembered in `received` and raised as `Interrupted`
(a KeyboardInterrupt) in the main thread. A library may swallow that exception (torch's C import of
numpy does); what was remembered is not lost:

- every commit point (the rename that makes an output visible: core.format.staging) runs inside
  `committing()`, which refuses to commit once a signal was received, and defers a signal that
  arrives during the renames until they are done, so a rename is never cut in half;
- the CLI imports torch inside `deferred()`: a signal during that import is raised right after it
  (torch's C++ import code swallows a KeyboardInterrupt, or aborts the process on one);
- the CLI turns a remembered signal into exit code 128 + signum at the end of the command, even
  when the command itself returned 0.

Outside the CLI (the Python API) nothing is installed: `committing()` then defers SIGINT only for
the renames themselves and replays it after them to the handler that was there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None  # what getsignal returns

received: list[int] = []  # the signals seen since the handlers were installed (the CLI reads and clears it)
_state = {"deferring": 0, "recording": 1, "installed": 0, "retries": 0}


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while a command ran; `signum` says which (the exit code is 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


RETRY_S = 0.02  # a signal that arrived inside an import is sent again this much later
MAX_RETRIES = 500  # ... for at most 10 s: an import that hangs still ends on Ctrl-C


def on_signal(signum: int, frame: FrameType | None) -> None:
    """The handler: remember `signum`, and raise Interrupted unless a commit is running. Inside an
    import it is sent again a moment later instead (see `_importing`)."""
    if not _state["deferring"] and _state["retries"] < MAX_RETRIES and _importing(frame):
        _state["retries"] += 1
        if _state["recording"]:  # remembered now: a command whose every moment imports still ends 128 + signum
            received.append(signum)
        threading.Timer(RETRY_S, os.kill, (os.getpid(), signum)).start()
        return
    _state["retries"] = 0
    if _state["recording"] or _state["deferring"]:  # a deferred one is raised after the commit
        received.append(signum)
    if not _state["deferring"]:
        raise Interrupted(signum)


def _importing(frame: FrameType | None) -> bool:
    """Whether the main thread is inside an import. An exception raised there can land in a compiled
    extension's own import code, which does not expect one: pydantic_core (pyo3) panics with a
    traceback when its import of `datetime` is interrupted, torch's aborts the process. So the
    signal is remembered (no commit happens after it, the command ends 128 + signum) and sent again
    every RETRY_S until it lands outside an import, where it raises as usual."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def installed() -> bool:
    """Whether `install` put `on_signal` in place (a handler installed later may wrap it: worker_group's)."""
    return bool(_state["installed"])


def install() -> dict[int, Handler]:
    """Install `on_signal` for SIGINT and SIGTERM (main thread only); the handlers it replaced."""
    if not _main_thread():
        return {}
    previous: dict[int, Handler] = {s: signal.signal(s, on_signal) for s in SIGNALS}
    _state["installed"] = 1
    return previous


def restore(previous: dict[int, Handler]) -> None:
    """Put back the handlers `install` returned."""
    for s, handler in previous.items():
        signal.signal(s, handler)
    _state["installed"] = 0


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM are remembered and raise Interrupted. When the
    handlers are already installed (by the script's entry) they stay, with what they remembered;
    otherwise `received` is emptied before and after, and the previous handlers come back after it."""
    if installed() or not _main_thread():
        yield
        return
    received.clear()
    previous = install()
    try:
        yield
    finally:
        restore(previous)
        received.clear()


@contextlib.contextmanager
def not_remembered() -> Iterator[None]:
    """For commands that handle Ctrl-C themselves (chat stops an answer, serve drains): signals
    still raise Interrupted, but a caught one is not held against what follows."""
    _state["recording"] -= 1
    try:
        yield
    finally:
        _state["recording"] += 1


def pending() -> int | None:
    """The first signal remembered, or None."""
    return received[0] if received else None


def check() -> None:
    """Raise Interrupted when a signal was received (and perhaps swallowed by a library)."""
    signum = pending()
    if signum is not None:
        raise Interrupted(signum)


def ignore_from_now() -> None:
    """The script's command is over and its exit code decided: SIGINT and SIGTERM are ignored from
    now on (main thread only). Python's finalization puts its own handlers back to SIG_DFL, so a
    signal during the interpreter's teardown (torch's modules take a while to free) would otherwise
    kill a process that completed its work, with status -SIGINT; an ignored signal is left as it is."""
    _state["deferring"] += 1  # a signal already queued for the handler is only remembered
    if _main_thread():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """With bestiary's handlers installed: a signal during the block is only remembered, and raised
    (Interrupted) right after it. For what must not be cut in half: the renames of a commit, and the
    import of torch, whose C++ import code swallows a KeyboardInterrupt (its import of numpy) or
    aborts the process on one (SIGABRT while torch.nn loads). Elsewhere the block runs as it is."""
    if not installed() or not _main_thread():  # only the main thread runs the handler
        yield
        return
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
    check()


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """Around the renames that make an output visible: refused (Interrupted) when a signal was
    received before; a signal during the block is held until the block is done, then raised."""
    if not installed():
        with _deferred_sigint():
            yield
        return
    check()
    with deferred():
        yield
    check()


@contextlib.contextmanager
def _deferred_sigint() -> Iterator[None]:
    """Without bestiary's handlers (the Python API): hold SIGINT for the block, then hand it to the
    handler that was installed (Python's default raises KeyboardInterrupt). Elsewhere than in the
    main thread, or under a handler not installed from Python, the block runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if not _main_thread() or previous is None:
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)
    elif caught and previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
