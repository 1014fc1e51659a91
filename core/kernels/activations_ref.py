"""Activation functions by their HF names, in torch: the reference of the kernels and the CPU path.

    silu(x)      = x * sigmoid(x)                                   (names: silu, swiglu)
    gelu(x)      = x/2 * (1 + erf(x / sqrt(2)))                      (gelu)
    gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))  (gelu_new, gelu_pytorch_tanh)
    relu(x)      = max(x, 0)                                        (relu)

ACT_CODES numbers them for the kernels (Triton: core.kernels.activations, C: core.kernels.cpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "swiglu": F.silu,
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Activation name -> the code the kernels use.
ACT_CODES = {"silu": 0, "swiglu": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "relu": 3}


def activation(name: str):
    """The activation function called `name` (HF names)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported; expected one of {sorted(ACTIVATIONS)}") from None


def act_and_mul_ref(f: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """act(f) * g in f's dtype: f, g [T, I] -> [T, I]."""
    return ACTIVATIONS[act](f) * g


def activation_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x) in x's dtype."""
    return ACTIVATIONS[act](x)
