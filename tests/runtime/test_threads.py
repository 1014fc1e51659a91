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
