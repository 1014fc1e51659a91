"""Threads outside the decode loop: every `bestiary` command takes its count at start (core.runtime.threads.
start_command), a count bestiary chose stays bestiary's (the governor may still change it), and each test
process takes its share of the CPUs, exported to the processes it starts (tests/helpers/thread_share.py)."""

from __future__ import annotations

import pytest
import thread_share
import torch

from bestiary.core.cli.main import main
from bestiary.core.format.resources import Limit
from bestiary.core.runtime import threads


@pytest.fixture(autouse=True)
def own_threads(monkeypatch):
    """torch's count restored and bestiary's remembered choices emptied around each test."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_OURS", set())
    yield
    torch.set_num_threads(before)


def settles_to(monkeypatch, count: int) -> list[int]:
    """ThreadGovernor.settle replaced by one that picks `count` (as a loaded machine would); returns the list of
    the usable counts it was asked about."""
    asked: list[int] = []

    def settle(self, seconds: float = threads.SETTLE_S, loadavg=None) -> int:
        asked.append(self.usable)
        threads._choose(count)
        return count

    monkeypatch.setattr(threads.ThreadGovernor, "settle", settle)
    return asked


def test_commands_without_num_threads_take_the_environments_count(monkeypatch, tmp_path) -> None:
    """`bestiary convert` has no --num_threads; before, it ran on torch's start-up count whatever
    BESTIARY_NUM_THREADS said (2 threads in a test worker whose share is 1)."""
    monkeypatch.setenv(threads.ENV, "1")
    torch.set_num_threads(2)
    assert main(["convert", "--model_dir", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "out")]) == 2
    assert torch.get_num_threads() == 1


def test_a_bad_environment_count_is_one_line_for_every_command(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv(threads.ENV, "two")
    assert main(["build", "--checkpoint_dir", str(tmp_path), "--output_dir", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BESTIARY_NUM_THREADS='two': expected a whole number" in err


def test_start_command_looks_at_the_load_only_when_bestiary_chooses(monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 2)
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(2, "CPU affinity"))
    asked = settles_to(monkeypatch, 1)
    torch.set_num_threads(2)
    assert threads.start_command(None) == 1 and torch.get_num_threads() == 1 and asked == [2]
    assert threads.start_command(2) == 2 and torch.get_num_threads() == 2 and asked == [2]  # asked for: no look
    monkeypatch.setenv(threads.ENV, "1")
    assert threads.start_command(None) == 1 and asked == [2]


def test_a_count_bestiary_chose_is_not_the_programs_own(monkeypatch) -> None:
    """After a command's start settled on 1 thread, LLM() must still see nobody asked (so it governs, over every
    usable CPU); a count the program set itself stays kept."""
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 2)
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(2, "CPU affinity"))
    settles_to(monkeypatch, 1)
    torch.set_num_threads(2)
    threads.start_command(None)
    assert torch.get_num_threads() == 1 and threads.bestiary_chooses(None)
    assert threads.set_threads() == 2  # LLM's call: the whole default again, for its governor to steer
    torch.set_num_threads(3)  # the program's own
    assert not threads.bestiary_chooses(None) and threads.set_threads() == 3


def test_process_share(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 4)
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(2, "cgroup CPU quota of /x"))
    asked = settles_to(monkeypatch, 1)
    assert threads.process_share(2) == 1 and threads.process_share(3) == 1 and asked == []
    assert threads.process_share(1) == 1 and asked == [2]  # alone: what the others leave
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(8, "CPU affinity"))
    assert threads.process_share(2) == 2  # never more than torch's default (4) between them


def test_workers_choose_again_after_the_xdist_controller(monkeypatch) -> None:
    """The controller imports conftest.py first (one process: the whole share) and its workers inherit its
    environment: before, each worker kept the controller's BESTIARY_NUM_THREADS=2 (2 threads per worker on 2
    cores, OMP_NUM_THREADS unset for their subprocesses)."""
    for name in (threads.ENV, thread_share.CHOSEN, thread_share.OMP):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(thread_share, "process_share", lambda processes: 2 // processes)
    assert thread_share.take_share(1) == 2 and torch.get_num_threads() == 2  # the controller / `-n 0`
    assert thread_share.take_share(2) == 1 and torch.get_num_threads() == 1  # a worker of two
    env = thread_share.os.environ
    assert (env[threads.ENV], env[thread_share.OMP], env[thread_share.CHOSEN]) == ("1", "1", "1")


def test_the_users_counts_are_kept(monkeypatch) -> None:
    monkeypatch.setattr(thread_share, "process_share", lambda processes: 1)
    monkeypatch.delenv(thread_share.CHOSEN, raising=False)
    monkeypatch.setenv(threads.ENV, "3")
    monkeypatch.setenv(thread_share.OMP, "4")
    assert thread_share.take_share(2) == 3 and torch.get_num_threads() == 3
    assert thread_share.os.environ[thread_share.OMP] == "4"
    monkeypatch.delenv(threads.ENV)
    assert thread_share.take_share(2) == 1 and thread_share.os.environ[thread_share.OMP] == "4"
