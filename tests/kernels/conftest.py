"""Kernel tests: every Triton kernel against its torch reference on small, odd shapes.

Compiled on a GPU where there is one, else on the CPU through the Triton interpreter
(BESTIARY_KERNEL_TEST_DEVICE=cpu|cuda chooses; tests/conftest.py sets TRITON_INTERPRET=1 for the
CPU before any test module imports a kernel module, since `@triton.jit` reads it when it decorates a
kernel). This conftest sets it too and refuses kernel modules imported before it, for a run of this
folder alone in a process that already imported some (mutmut's).
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
    # Modules that imported triton hold @triton.jit kernels; the triton-free ones (dispatch, metadata,
    # the *_ref references, kernels.cpu) may load earlier.
    _early = sorted(m for m, mod in list(sys.modules.items())
                    if m.startswith("bestiary.core.kernels.") and getattr(mod, "triton", None) is not None)
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
