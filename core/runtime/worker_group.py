"""The ranks of a multi-rank engine: one process per rank on torch.distributed.

A process holds one world (torch.distributed allows one default group per process); the
`WorkerGroup` is that world seen from rank 0, the driver:

1. start: under torchrun (RANK / WORLD_SIZE in the environment) every process is already a
   rank and joins from the environment (`env://`, c10d rendezvous across nodes). Otherwise
   the driver spawns ranks 1..N-1 (torch.multiprocessing, "spawn") and joins them over
   `tcp://127.0.0.1:<free port>` as rank 0.
2. join: the default group carries the model's collectives (gloo on the CPU, nccl on
   CUDA) with a short timeout (`BESTIARY_DIST_TIMEOUT`, 20 s: a rank that hangs inside a
   step); a second gloo group with no practical timeout carries the control messages
   (core.runtime.step_broadcast), so idle ranks wait as long as the driver does.
3. watch: a driver thread waits on every spawned rank's process sentinel and pipe. A rank
   that dies or reports an error stops the whole group: one line on stderr naming the rank
   and the cause, the other ranks terminated, the driver exits with status 1. A spawned
   rank whose driver dies sees its pipe close and exits; ranks ignore SIGINT, so Ctrl-C
   reaches the driver only, whose exit ends them.

Pipeline and expert parallelism reuse the same world: a rank's (tp, pp) coordinates come
from the engine's Mapping; only the per-step messages differ.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from bestiary.core.format import stream_line
from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.threads import default_threads

STEP_TIMEOUT_S = float(os.environ.get("BESTIARY_DIST_TIMEOUT", "20"))
JOIN_TIMEOUT = timedelta(minutes=10)  # the ranks' start (torch imported, weights loaded on a busy machine): not a hang
CTRL_C_DEADLINE_S = 10.0  # after Ctrl-C the driver and its ranks are gone within this (WorkerGroup._bound_ctrl_c)
IDLE_TIMEOUT = timedelta(days=365)  # the control group: ranks wait for the driver's next message


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when this process was started by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def check_device(device: str) -> None:
    """`device` is "cpu", "cuda" or "cuda:N" of a GPU this machine has (else one line saying so)."""
    if device == "cpu":
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise BestiaryError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(index or 0) >= count:
        raise BestiaryError(f"--device {device}: this machine has {count} CUDA device(s)")


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: the CPU, or CUDA device (N +) local_rank for "cuda" ("cuda:N")."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{first + local_rank}"


def backend_for(device: str) -> str:
    """nccl for CUDA ranks, gloo for CPU ones."""
    return "nccl" if device.startswith("cuda") else "gloo"


def free_port() -> int:
    """A TCP port on localhost no one listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_world(rank: int, world_size: int, device: str, init_method: str = "env://") -> dist.ProcessGroup:
    """init_process_group for this rank; returns the control group (gloo, no practical timeout). The ranks meet
    within JOIN_TIMEOUT (a spawned rank that dies meanwhile stops the group: WorkerGroup._watch), and only then
    does the short step timeout apply: with it as the meeting's timeout too, ranks still starting on a busy
    machine failed the world ("2/4 clients joined") before any step ran."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=JOIN_TIMEOUT))
    step = timedelta(seconds=STEP_TIMEOUT_S)
    store.set_timeout(step)  # (as init_process_group sets the store it makes)
    dist.init_process_group(backend_for(device), store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=step)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def process_state(pid: int | None) -> str:
    """The one-letter state of a process (R, S, T stopped, D, Z; '?' when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def settled_exitcode(process, timeout_s: float = 2.0) -> int | None:
    """A dead process's exit code. Two threads (the watch thread and a failed collective) may reap
    it at once: the one whose waitpid lost reads None until the winner has stored the code."""
    deadline = time.monotonic() + timeout_s
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode


def describe_exit(code: int | None) -> str:
    """'was killed by SIGKILL' / 'exited with status 3' of a multiprocessing exitcode."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class SpawnedRank:
    """A rank process the driver started, and the driver's end of its pipe."""

    rank: int
    process: BaseProcess  # a torch.multiprocessing SpawnProcess
    conn: Connection


@dataclass
class WorkerGroup:
    """The world of ranks seen from rank 0 (the driver). See the module docstring."""

    world_size: int
    device: str  # rank 0's device
    control: dist.ProcessGroup
    spawned: list[SpawnedRank] = field(default_factory=list)
    closing: bool = False
    engine_keys: set[int] = field(default_factory=set)  # engines the ranks hold (step_broadcast.Load)
    engine_refs: dict[int, weakref.ref] = field(default_factory=dict)  # key -> rank 0's Engine (held or gone)
    in_step: bool = False  # between a step's control message and the end of its forward
    sending_since: float | None = None  # monotonic time the driver began sending a step's message
    _watchdog: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sigint: tuple[Any, Any] | None = None  # (the Ctrl-C handler _bound_ctrl_c installed, the one it wraps)

    # --- 1. start ----------------------------------------------------------------------
    @classmethod
    def start(cls, world_size: int, device: str = "cpu", num_threads: int | None = None) -> WorkerGroup:
        """Rank 0 of a new world of `world_size` ranks (torchrun's, or spawned ranks 1..N-1)."""
        env = torchrun_env()
        if env is not None:
            rank, size, local_rank = env
            if size != world_size:
                raise BestiaryError(f"torchrun started {size} processes; the engine has {world_size} ranks: "
                                    f"use --nproc_per_node / --nnodes giving {world_size}")
            if rank != 0:
                raise RuntimeError("WorkerGroup.start runs on rank 0; other ranks serve (step_broadcast.serve)")
            device = rank_device(device, local_rank)
            group = cls(world_size, device, join_world(0, world_size, device))
            atexit.register(group.close)
            return group
        threads = num_threads or default_threads(world_size)  # the usable CPUs shared by the ranks
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        spawned = []
        for rank in range(1, world_size):
            driver_end, rank_end = ctx.Pipe()
            process = ctx.Process(target=_spawned_rank_main, name=f"bestiary-rank{rank}", daemon=True,
                                  args=(rank, world_size, init_method, rank_device(device, rank), threads, rank_end))
            process.start()
            rank_end.close()
            spawned.append(SpawnedRank(rank, process, driver_end))
        # control is None only until join_world below (the watch thread must run while the ranks join)
        group = cls(world_size, rank_device(device, 0), None, spawned)  # type: ignore[arg-type]
        group._watch()
        group._bound_ctrl_c()
        torch.set_num_threads(threads)
        group.control = join_world(0, world_size, group.device, init_method)
        atexit.register(group.close)
        return group

    # --- 3. watch ----------------------------------------------------------------------
    def _watch(self) -> None:
        """A daemon thread: the first spawned rank to die or report an error stops the group."""
        if not self.spawned:
            return
        threading.Thread(target=self._watch_loop, name="bestiary-rank-watch", daemon=True).start()

    def _watch_loop(self) -> None:
        # what `wait` takes and returns (process sentinels: int; pipe ends: Connection) -> their rank
        by_handle: dict[Any, SpawnedRank] = {}
        for s in self.spawned:
            by_handle[s.process.sentinel] = s
            by_handle[s.conn] = s
        while by_handle:
            for handle in wait(list(by_handle)):
                s = by_handle[handle]
                if handle is s.conn:
                    try:
                        cause = s.conn.recv()
                    except (EOFError, OSError):
                        del by_handle[handle]
                        continue
                    stuck = self._stuck_ranks()  # a rank whose collective timed out waiting on a hung peer
                    if stuck and stuck[0] is not s:
                        self._fail_stuck(stuck[0])
                    dead = self._dead_peer(s)  # a rank whose socket closed because its peer died
                    if dead is not None:
                        self.fail(dead.rank, dead.process.pid, describe_exit(settled_exitcode(dead.process)))
                    self.fail(s.rank, s.process.pid, cause)
                else:
                    s.process.join(timeout=1)
                    if not self.closing:
                        self.fail(s.rank, s.process.pid, describe_exit(settled_exitcode(s.process)))
                    del by_handle[handle]

    def fail(self, rank: int, pid: int | None, cause: str) -> None:
        """Stop everything after rank `rank` failed: one line, the other ranks ended, exit status 1."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
        who = f"rank {rank}" + (f" (pid {pid})" if pid else "")
        stream_line.error_line(f"bestiary: {who} {cause}; stopping all {self.world_size} ranks")  # on a fresh line
        self._terminate(graceful=False)
        os._exit(1)

    def collective_failed(self, err: BaseException) -> None:
        """Rank 0's own collective raised (a peer's socket closed, or the step timeout): name the rank
        the watch thread finds dead within a few seconds, else report the error as rank 0's."""
        for _ in range(20):
            if self.closing:
                threading.Event().wait(5)  # the watch thread is reporting and will exit the process
            dead = [s for s in self.spawned if not s.process.is_alive()]
            if dead:
                self.fail(dead[0].rank, dead[0].process.pid, describe_exit(settled_exitcode(dead[0].process)))
            threading.Event().wait(0.1)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        stuck = self._stuck_ranks()
        if stuck:
            self._fail_stuck(stuck[0])
        self.fail(0, os.getpid(), f"lost its peers: {first}")

    def _dead_peer(self, reporter: SpawnedRank, within_s: float = 1.0) -> SpawnedRank | None:
        """A spawned rank other than `reporter` that died, waited for up to `within_s`: a killed rank's
        sockets close before it is reaped, so its peers' errors can arrive first; the death is the cause."""
        deadline = time.monotonic() + within_s
        while True:
            dead = [p for p in self.spawned if p is not reporter and not p.process.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead[0] if dead else None
            threading.Event().wait(0.02)

    def _stuck_ranks(self) -> list[SpawnedRank]:
        """Spawned ranks that are stopped (T) or in uninterruptible sleep (D): hung, not failed."""
        return [s for s in self.spawned if process_state(s.process.pid) in ("T", "t", "D")]

    def _fail_stuck(self, s: SpawnedRank) -> None:
        self.fail(s.rank, s.process.pid, f"did not answer within {STEP_TIMEOUT_S:g} s "
                  f"(process state {process_state(s.process.pid)})")

    def _terminate(self, graceful: bool = True) -> None:
        """End the spawned ranks: SIGTERM, then SIGKILL after 5 s (at once when not `graceful`)."""
        for s in self.spawned:
            if s.process.is_alive():
                s.process.terminate() if graceful else s.process.kill()
        for s in self.spawned:
            s.process.join(timeout=5)
            if s.process.is_alive():
                s.process.kill()
                s.process.join(timeout=5)

    def _bound_ctrl_c(self) -> None:
        """Ctrl-C (SIGINT) raises KeyboardInterrupt as usual, and also arms a deadline: if the
        driver has not exited CTRL_C_DEADLINE_S later (its unwinding or atexit cleanup waits on a
        rank that is inside a collective), the ranks are killed and the driver exits with status
        130 and one line. Only the main thread can install signal handlers; elsewhere nothing
        changes."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame) -> None:
            if not self.closing:  # a closed group has no ranks to stop: the Ctrl-C is only the caller's
                threading.Thread(target=self._exit_after_deadline, name="bestiary-ctrl-c", daemon=True).start()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)
        self._sigint = (on_sigint, previous)

    def _unbind_ctrl_c(self) -> None:
        """close(): the handler _bound_ctrl_c installed gives way to the one it wrapped (when it is still
        the one in place), so a later Ctrl-C in a long-lived process is only that process's again."""
        if self._sigint is None or threading.current_thread() is not threading.main_thread():
            return
        mine, previous = self._sigint
        if signal.getsignal(signal.SIGINT) is mine:
            signal.signal(signal.SIGINT, previous)
        self._sigint = None

    def _exit_after_deadline(self) -> None:
        time.sleep(CTRL_C_DEADLINE_S)
        with self._lock:  # the watch thread must not report the ranks killed below as failures
            self.closing = True
        sys.stderr.write(f"bestiary: KeyboardInterrupt: the ranks did not stop within {CTRL_C_DEADLINE_S:g} s; "
                         f"killing all {self.world_size} ranks\n")
        sys.stderr.flush()
        self._terminate(graceful=False)
        os._exit(130)

    # --- the step in flight ------------------------------------------------------------------
    def step_begins(self) -> None:
        """The driver starts a step (its control message first); the watchdog times the message."""
        self.in_step, self.sending_since = True, time.monotonic()
        if self._watchdog is None and self.spawned:
            self._watchdog = threading.Thread(target=self._watch_sends, name="bestiary-step-watch", daemon=True)
            self._watchdog.start()

    def step_sent(self) -> None:
        """Every rank took the step's message (they now run the step's collectives, which time out)."""
        self.sending_since = None

    def step_ends(self) -> None:
        self.in_step = False

    def _watch_sends(self) -> None:
        """Ranks finish a step with the driver (its logits all-gather): a rank that does not take the
        next message within STEP_TIMEOUT_S hangs. Name it (a stopped one first) and stop the group."""
        while not self.closing:
            since = self.sending_since
            if since is not None and time.monotonic() - since > STEP_TIMEOUT_S:
                alive = [s for s in self.spawned if s.process.is_alive()]
                stuck = [s for s in self._stuck_ranks() if s in alive] or alive
                if stuck:
                    self._fail_stuck(stuck[0])
            time.sleep(0.5)

    # --- the end -------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every rank to exit (a None message), wait for the spawned ones, leave the world."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
        from bestiary.core.runtime.step_broadcast import send

        if self.in_step:  # interrupted inside a step (Ctrl-C): the ranks wait in it
            self._terminate(graceful=False)
        with contextlib.suppress(Exception):  # a peer already gone: terminated below
            send(self, None)
        for s in self.spawned:
            s.process.join(timeout=10)
        self._terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._unbind_ctrl_c()
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None


_CURRENT: WorkerGroup | None = None


def worker_group(world_size: int, device: str = "cpu", num_threads: int | None = None) -> WorkerGroup:
    """This process's worker group of `world_size` ranks on `device`, started on first use and
    reused after (one world per process: a group of another size replaces an idle one)."""
    global _CURRENT
    if _CURRENT is not None and not _CURRENT.closing:
        if _CURRENT.world_size == world_size and _CURRENT.device == rank_device(device, 0):
            return _CURRENT
        if live_engines(_CURRENT):
            raise BestiaryError(f"this process runs a {_CURRENT.world_size}-rank engine on {_CURRENT.device}; "
                                f"close that LLM before loading one with {world_size} ranks on {device}")
        _CURRENT.close()
    _CURRENT = WorkerGroup.start(world_size, device, num_threads)
    return _CURRENT


def live_engines(group: WorkerGroup) -> set[int]:
    """Keys of the engines the group's ranks hold whose rank-0 Engine is still referenced here.

    An LLM dropped without close() leaves its key loaded; once its Engine is garbage (collected
    here: the driven model's forward refers back to the model, a cycle), it no longer counts, so
    its ranks can drop it and a group of another size can replace this one."""
    if not group.engine_keys:
        return set()
    gc.collect()
    return {k for k in group.engine_keys if (ref := group.engine_refs.get(k)) is None or ref() is not None}


def _spawned_rank_main(rank: int, world_size: int, init_method: str, device: str, threads: int,
                       conn: Connection) -> None:
    """Entry point of a spawned rank: join, then serve the driver's messages until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the driver stops the group
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_driver, args=(conn,), name="bestiary-driver-watch", daemon=True).start()
    try:
        control = join_world(rank, world_size, device, init_method)
        from bestiary.core.runtime.step_broadcast import serve

        serve(rank, device, control)
    except BaseException as err:  # noqa: BLE001 - reported to the driver as this rank's one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        try:
            conn.send(f"failed: {type(err).__name__}: {first}")
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _exit_with_driver(conn: Connection) -> None:
    """A spawned rank's thread: when the driver's end of the pipe closes (it exited or died), exit."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        os._exit(1)
