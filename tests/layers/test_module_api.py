"""The layers keep torch's nn.Module API: no layer shadows one of nn.Module's names.

Rotary's in-place rotation was called `apply`, so `model.apply(fn)` (torch's recursive visit,
e.g. a weight init) called `Rotary.apply(fn)` and failed; Rotary2D held an int as `half`,
shadowing nn.Module.half(). They are `rotate` and `half_dim` now.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch
from torch import nn

import bestiary.core.layers as layers
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.rotary_2d import Rotary2D
from bestiary.core.layers.self_attention import SelfAttention

# what a layer is meant to define over nn.Module's own (plus the class machinery every class has)
OVERRIDES = {"forward", "extra_repr", "__init__", "__doc__", "__module__", "__qualname__", "__annotations__",
             "__dict__", "__weakref__", "__firstlineno__", "__static_attributes__", "__parameters__",
             "__orig_bases__", "__annotate_func__", "__annotations_cache__"}


def _layer_classes() -> list[type[nn.Module]]:
    """Every nn.Module subclass defined in a bestiary.core.layers module."""
    found = []
    for info in pkgutil.iter_modules(layers.__path__):
        module = importlib.import_module(f"{layers.__name__}.{info.name}")
        found += [c for c in vars(module).values()
                  if inspect.isclass(c) and issubclass(c, nn.Module) and c.__module__ == module.__name__]
    return found


def test_no_layer_class_shadows_a_module_name():
    module_names = set(dir(nn.Module))
    shadowed = {f"{c.__module__}.{c.__qualname__}.{name}" for c in _layer_classes()
                for name in vars(c) if name in module_names and name not in OVERRIDES}
    assert not shadowed


def test_rotary2d_instance_keeps_module_half():
    rot = Rotary2D(16, 10000.0, 32)
    assert not set(vars(rot)) & set(dir(nn.Module))
    assert rot.half() is rot  # nn.Module.half, not an int


def test_module_apply_visits_rotary_layers():
    """torch's model.apply(fn) reaches every submodule of attention with either rotary."""
    blocks = nn.ModuleList([SelfAttention(64, 4, 4, 16, rotary=rot)
                            for rot in (Rotary(16, 16, 10000.0, None, 32), Rotary2D(16, 10000.0, 32))])
    seen: list[str] = []
    blocks.apply(lambda m: seen.append(type(m).__name__))
    assert seen.count("Rotary") == 2 and seen.count("Rotary2D") == 1  # Rotary2D holds a Rotary


def test_rotate_matches_two_half_rotations():
    """Rotary2D.rotate: the first half by positions, the second by block positions."""
    rot = Rotary2D(16, 10000.0, 32)
    pos = torch.tensor([[0, 1, 2, 2], [0, 0, 1, 2]])  # [2, T]
    cos, sin = rot.cos_sin(pos, torch.float32)
    x = torch.randn(4, 3, 16)
    out, ref = x.clone(), x.clone()
    rot.rotate(out, cos, sin)
    rot.inner.rotate(ref[..., :8], cos[0], sin[0])
    rot.inner.rotate(ref[..., 8:], cos[1], sin[1])
    torch.testing.assert_close(out, ref)
