"""core.runtime.threads: the default thread count follows the usable CPUs and BESTIARY_NUM_THREADS,
and a count the program set itself is kept."""

from __future__ import annotations

import pytest
import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.resources import Limit
from bestiary.core.runtime import threads


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_quota_below_torch_default_wins(monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", 16)
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(1, "cgroup CPU quota of /x"))
    assert threads.default_threads() == 1
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(64, "CPU affinity"))
    assert threads.default_threads() == 16  # never more than torch's own choice (physical cores)
    assert threads.default_threads(ranks=4) == 4


def test_environment_overrides(monkeypatch) -> None:
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.default_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(threads.ENV, bad)
        with pytest.raises(BestiaryError, match=f"BESTIARY_NUM_THREADS='{bad}': expected a whole number"):
            threads.default_threads()


def test_set_threads_keeps_the_programs_own_count(monkeypatch) -> None:
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: Limit(1, "CPU affinity"))
    torch.set_num_threads(threads._TORCH_DEFAULT)
    assert threads.set_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(threads, "_TORCH_DEFAULT", torch.get_num_threads() + 5)  # the program changed it
    assert threads.set_threads() == 1  # kept, not reset
    assert threads.set_threads(2) == 2 and torch.get_num_threads() == 2  # an explicit count always applies


def write_proc(root, cpu_busy: list[int], own: int) -> None:
    """Fake /proc/stat (busy ticks per CPU, in the user field) and /proc/self/stat (utime = own)."""
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    lines = [f"cpu  {sum(cpu_busy)} 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0" for i, b in enumerate(cpu_busy)]
    (root / "proc" / "stat").write_text("\n".join(lines) + "\n")
    fields = ["S"] + ["0"] * 10 + [str(own), "0"] + ["0"] * 30
    (root / "proc" / "self" / "stat").write_text("123 (python x) " + " ".join(fields) + "\n")


def test_governor_follows_the_cpus_others_leave(tmp_path, monkeypatch) -> None:
    """2 usable CPUs: another process busy on one (100 ticks/s) -> 1 thread; gone -> 2; our own work never counts."""
    now = [0.0]
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
    torch.set_num_threads(2)
    write_proc(tmp_path, [0, 0], 0)
    gov = threads.ThreadGovernor(2, {0, 1}, root=tmp_path, clock=lambda: now[0])
    now[0] = 0.2
    write_proc(tmp_path, [100, 100], 200)  # before INTERVAL_S: not looked at
    assert gov.tick() == 2
    now[0] = 1.0
    write_proc(tmp_path, [200, 200], 200)  # 1 s: 400 busy ticks, 200 ours -> others = 2.0 CPUs
    assert gov.tick() == 1 and torch.get_num_threads() == 1
    now[0] = 2.0
    write_proc(tmp_path, [300, 210], 300)  # others: 110 - 100 = 10 ticks = 0.1 CPU -> floor(2.15) = 2
    assert gov.tick() == 2 and torch.get_num_threads() == 2
    now[0] = 3.0
    write_proc(tmp_path, [400, 400], 500)  # 290 busy ticks, 200 ours: others 0.9 -> floor(1.35) = 1
    assert gov.tick() == 1


def test_governor_reads_only_the_cpus_of_its_mask(tmp_path) -> None:
    write_proc(tmp_path, [10, 20, 40], 0)
    assert threads.cpu_busy_ticks({0, 2}, tmp_path) == 50
    assert threads.own_ticks(tmp_path) == 0
    assert threads.cpu_busy_ticks({0}, tmp_path / "missing") is None


def test_only_a_count_nobody_asked_for_is_governed(monkeypatch) -> None:
    """No num_threads, no BESTIARY_NUM_THREADS, torch's count untouched: bestiary chooses (LLM then governs)."""
    monkeypatch.delenv(threads.ENV, raising=False)
    torch.set_num_threads(threads._TORCH_DEFAULT)
    assert threads.bestiary_chooses(None) and not threads.bestiary_chooses(3)
    monkeypatch.setenv(threads.ENV, "1")
    assert not threads.bestiary_chooses(None)


def test_settle_looks_at_once_only_on_a_loaded_machine(tmp_path, monkeypatch) -> None:
    """settle(): a load average above half the usable CPUs samples the CPUs now (others busy on one of two:
    1 thread before the engine loads); a quiet one costs nothing."""
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(threads.time, "sleep", lambda s: write_proc(tmp_path, [10, 1], 1))  # others: 1 CPU for 0.1 s
    now = iter([0.0, 0.0, 0.1, 0.1])
    torch.set_num_threads(2)
    write_proc(tmp_path, [0, 0], 0)
    gov = threads.ThreadGovernor(2, {0, 1}, root=tmp_path, clock=lambda: next(now))
    assert gov.settle(loadavg=lambda: (0.4, 0, 0)) == 2  # quiet: no sample, no sleep
    assert gov.settle(loadavg=lambda: (3.0, 0, 0)) == 1 and torch.get_num_threads() == 1
