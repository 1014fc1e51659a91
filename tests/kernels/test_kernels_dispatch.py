"""dispatch: the mode switch, its env var, and what importing the layers loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels import dispatch


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("BESTIARY_KERNELS", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)


def test_auto_picks_torch_for_cpu_tensors():
    x = torch.randn(2, 3)
    with dispatch.kernels_mode("auto"):
        assert not dispatch.use_triton(x)
    with dispatch.kernels_mode("triton"):
        assert dispatch.use_triton(x)
    with dispatch.kernels_mode("torch"):
        assert not dispatch.use_triton(x)


def test_kernels_mode_restores_on_error():
    before = dispatch.mode()
    with pytest.raises(RuntimeError), dispatch.kernels_mode("triton"):
        raise RuntimeError("boom")
    assert dispatch.mode() == before


def test_bad_mode_is_a_one_line_error():
    with pytest.raises(ConfigError, match="expected one of auto, triton, torch"):
        dispatch.set_mode("cuda")


def test_env_var_sets_the_mode():
    code = "from bestiary.core.kernels import dispatch; print(dispatch.mode())"
    assert _run(code, BESTIARY_KERNELS="torch").stdout.strip() == "torch"
    bad = _run(code, BESTIARY_KERNELS="fast")
    assert bad.returncode != 0 and "BESTIARY_KERNELS='fast': expected one of auto, triton, torch" in bad.stderr


def test_importing_layers_loads_no_triton():
    """Triton kernel modules (and triton) load on an op's first call, not when a model module is
    imported: what a model imports of core.kernels is triton-free (dispatch, metadata, references)."""
    code = (
        "import sys; import bestiary.core.layers.norm, bestiary.core.layers.rotary, bestiary.core.layers.mlp, "
        "bestiary.core.layers.attention, bestiary.core.layers.self_attention, bestiary.core.runtime.model; "
        "from bestiary.core.kernels import dispatch; "
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('bestiary.core.kernels.') "
        "and m.rsplit('.', 1)[-1] in dispatch.FAMILIES))"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
