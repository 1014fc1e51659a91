"""Kernels: one module per op family, each holding a private Triton kernel, its launcher and
the torch reference (the CPU path), side by side.

Layers call `bestiary.core.kernels.dispatch`, which picks Triton for CUDA tensors and torch
otherwise (see its docstring for the overrides). The family modules import triton, so
nothing here imports them eagerly: `dispatch` loads a family on its first call.
"""
