"""Kernel tests: every Triton kernel against its torch reference on small, odd shapes.

By default they run on the CPU through the Triton interpreter. `@triton.jit` reads
TRITON_INTERPRET when it decorates a kernel, i.e. when a kernel module is imported, so it
is set here, at collection, before any test module of this folder imports one (layers
import bestiary.core.kernels.dispatch only, which loads kernel modules on first use).
BESTIARY_KERNEL_TEST_DEVICE=cuda runs the same tests compiled on a GPU instead.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

DEVICE = os.environ.get("BESTIARY_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # Already "1" (set by the caller, or by this conftest in an earlier pytest.main of the same
    # process, as mutmut runs them): kernel modules imported before now were built for it.
    _was_set = os.environ.get("TRITON_INTERPRET") == "1"
    os.environ["TRITON_INTERPRET"] = "1"
    _early = sorted(m for m in sys.modules if m.startswith("bestiary.core.kernels.") and not m.endswith(".dispatch"))
    if _early and not _was_set:
        raise RuntimeError(
            f"kernel modules {_early} were imported before TRITON_INTERPRET=1 was set: "
            "their kernels are compiled for a GPU; run tests/kernels in its own process"
        )


@pytest.fixture
def device() -> torch.device:
    """Where the kernel tests put their tensors (cpu: the interpreter)."""
    return torch.device(DEVICE)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
