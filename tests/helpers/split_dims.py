"""The dim along which each tensor of a sharded checkpoint was split, read from tensor shapes alone.

The reassembly tests rebuild tp 1 tensors with the tp dims the model under test declares, so a
wrong declaration (a row-parallel layer declared column-parallel) round-trips. `split_dims`
compares every rank file's shapes with the tp 1 tensors instead; the tests compare its answer
with a table of the expected dims written by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.config import read_json

_LAYER = re.compile(r"\.layers\.\d+\.")

# Megatron-style splits, written by hand (not read from any model): column-parallel weights and
# biases along their output rows (0), row-parallel weights along their input columns (1) with the
# bias replicated (added once, after the all-reduce), norms and the embedding replicated (-1),
# lm_head along the vocabulary. Tests add their architecture's own tensors.
DENSE_TP_DIMS = {
    "transformer.vocab_embedding.weight": -1,
    "transformer.ln_f.weight": -1,
    "transformer.ln_f.bias": -1,
    "lm_head.weight": 0,
    "transformer.layers.*.input_layernorm.weight": -1,
    "transformer.layers.*.input_layernorm.bias": -1,
    "transformer.layers.*.post_layernorm.weight": -1,
    "transformer.layers.*.post_layernorm.bias": -1,
    "transformer.layers.*.attention.qkv.weight": 0,
    "transformer.layers.*.attention.qkv.bias": 0,
    "transformer.layers.*.attention.dense.weight": 1,
    "transformer.layers.*.attention.dense.bias": -1,
    "transformer.layers.*.mlp.fc.weight": 0,
    "transformer.layers.*.mlp.fc.bias": 0,
    "transformer.layers.*.mlp.gate.weight": 0,
    "transformer.layers.*.mlp.proj.weight": 1,
    "transformer.layers.*.mlp.proj.bias": -1,
}


def layer_pattern(key: str) -> str:
    """transformer.layers.3.mlp.fc.weight -> transformer.layers.*.mlp.fc.weight."""
    return _LAYER.sub(".layers.*.", key)


def split_dims(ckpt: Path, whole: dict[str, torch.Tensor]) -> dict[str, int]:
    """{layer pattern: the one dim along which every rank's tensor is smaller than the tp 1 tensor
    in `whole` (-1: same shape, replicated)}, over every rank file of `ckpt`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, tensor in whole.items():
        assert shapes.setdefault(layer_pattern(key), tuple(tensor.shape)) == tuple(tensor.shape), key
    dims: dict[str, int] = {}
    for rank in range(read_json(ckpt / "config.json")["mapping"]["world_size"]):
        for key, tensor in load_rank_weights(ckpt, rank).items():
            name, shape = layer_pattern(key), tuple(tensor.shape)
            full = shapes[name]
            assert len(shape) == len(full), f"{key}: rank {rank} shape {shape} vs {full}"
            smaller = [d for d, (a, b) in enumerate(zip(shape, full)) if a != b]
            assert len(smaller) <= 1 and all(shape[d] < full[d] for d in smaller), f"{key}: {shape} vs {full}"
            dim = smaller[0] if smaller else -1
            seen = dims.setdefault(name, dim)
            assert seen == dim, f"{key}: split along {dim} on rank {rank}, along {seen} elsewhere"
    return dims


def assert_split_dims(ckpt: Path, whole: dict[str, torch.Tensor], expected: dict[str, int], tp_size: int):
    """Every tensor of `ckpt` is split along the dim `expected` gives its layer pattern (none at
    tp 1); a tensor the table does not name fails (a new tensor needs its dim written down)."""
    dims = split_dims(ckpt, whole)
    assert not set(dims) - set(expected), f"no expected tp dim for {sorted(set(dims) - set(expected))}"
    assert dims == {name: expected[name] if tp_size > 1 else -1 for name in dims}
