"""Loader contracts that `make mutation` (tests/mutation_run.py loader) found untested.

Each test names the mutants of core/convert/loader.py it kills. No checkpoint: the functions
are called on hand-made targets and a stand-in source that only knows shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bestiary.core.convert.loader import Target, WeightsLoader, nearest
from bestiary.core.format.errors import WeightsError


def test_nearest_lists_at_most_three_close_names() -> None:
    """' (nearest: a, b, c)': the 3 closest names (difflib's order: score, then name descending),
    comma-separated; '' when none is close
    (nearest 1, 9, 10: n = 4 / difflib's default 3 / its default cutoff 0.6; 13, 15, 16: the
    empty and separator texts)."""
    names = ["layers.0.mlp.fc1", "layers.0.mlp.fc2", "layers.0.mlp.fc3", "layers.0.mlp.fc4", "embed"]
    want = " (nearest: layers.0.mlp.fc4, layers.0.mlp.fc3, layers.0.mlp.fc2)"
    assert nearest("layers.0.mlp.fc", names) == want
    assert nearest("layers.0.mlp.fc", names, n=4).count(",") == 3
    assert nearest("lm_head", names) == ""
    # ratio 2 * 6 / 22 = 0.55: kept at the cutoff 0.5, dropped at difflib's default 0.6
    assert nearest("abcdefghijk", ["abcdefxxxxx"]) == " (nearest: abcdefxxxxx)"


def loader_over(shapes: dict[str, tuple[int, ...]]) -> WeightsLoader:
    """A WeightsLoader whose source knows only `shapes` (what source_tp_dim reads)."""
    loader = WeightsLoader.__new__(WeightsLoader)
    loader.source = SimpleNamespace(shape=lambda key: shapes[key])
    return loader


def test_source_tp_dim_counts_from_the_end_for_stacked_targets() -> None:
    """A stacked [E, I, H] target read from one expert's [I, H]: tp_dim 1 -> dim 0 of the source,
    tp_dim 0 (the expert dim) is not in the source and is an error naming the key, at tp 2; at
    tp 1 and for a replicated target (tp_dim -1) the target's dim unchanged (source_tp_dim 1-3:
    the early return widened or narrowed; 11: the message)."""
    loader = loader_over({"expert": (8, 4), "dense": (6, 8, 4)})
    stacked = lambda dim: Target("moe.w", "moe", (6, 8, 4), torch.float32, dim)  # noqa: E731
    assert loader.source_tp_dim(stacked(1), "expert", 2) == 0
    assert loader.source_tp_dim(stacked(2), "expert", 2) == 1
    with pytest.raises(ValueError, match=r"tp_dim 0 of 'moe\.w' \(6, 8, 4\) is not in the source"):
        loader.source_tp_dim(stacked(0), "expert", 2)
    assert loader.source_tp_dim(stacked(0), "expert", 1) == 0
    assert loader.source_tp_dim(stacked(-1), "expert", 2) == -1
    assert loader.source_tp_dim(stacked(0), "dense", 2) == 0


def bare_loader(source_keys: set[str], used: set[str]) -> WeightsLoader:
    """A WeightsLoader holding only what check_all_used and the hook lookup read."""
    loader = WeightsLoader.__new__(WeightsLoader)
    loader._source_keys, loader.used, loader.label = source_keys, used, "src"
    loader.spec = SimpleNamespace(ignored_source_keys=["*.inv_freq"], name="Llama")
    loader._hooks = {}
    return loader


def test_check_all_used_counts_the_other_unused_keys() -> None:
    """Two unused keys: the first is named and ' (and 1 more)' follows; one: no suffix; an ignored
    glob is not counted (check_all_used 12-18: the suffix's condition, count and empty text)."""
    loader = bare_loader({"a.x", "a.y", "b", "r.inv_freq"}, {"b"})
    more = r"^src: source tensor 'a\.x' is not used by any Llama weight.* \(and 1 more\)$"
    with pytest.raises(WeightsError, match=more):
        loader.check_all_used(["a.z"])
    loader.used.add("a.y")
    with pytest.raises(WeightsError) as err:
        loader.check_all_used(["a.z"])
    assert str(err.value).endswith("weight (nearest: a.z, a.y)")


def test_prepended_hooks_are_tried_first() -> None:
    """prepend_hooks puts its globs before the architecture's (prepend_hooks 1: the map dropped)."""
    loader = bare_loader(set(), set())
    arch, first = (lambda *a: "arch"), (lambda *a: "first")  # noqa: E731
    loader._hooks = {"*.weight": arch}
    loader.prepend_hooks({"*.qkv.weight": first})
    assert loader.hook_for("l.qkv.weight") is first
    assert loader.hook_for("l.fc.weight") is arch


def test_translate_offsets_only_the_layer_index() -> None:
    """`layers.N` becomes `layers.(N + offset)` wherever it sits, an expert index is left alone, no
    offset by default (translate 1: default 1; 10: any digit section offset; 12: `layers` as the
    first section skipped)."""
    loader = bare_loader(set(), set())
    loader.spec.key_map, loader.spec.layer_key_maps = {"w": "weight"}, {}
    loader.source_map, loader.customized, loader.config = {}, {}, None
    assert loader.translate("layers.3.w", "layers.3", 2) == ["layers.5.weight"]
    assert loader.translate("transformer.layers.3.experts.4.w", "x", 2) == ["model.layers.5.experts.4.weight"]
    assert loader.translate("transformer.layers.0.w", "x") == ["model.layers.0.weight"]


def test_streamed_rows_are_cast_and_checked_for_non_finite_values() -> None:
    """load_rows (a block of a streamed 1-to-1 tensor): cast to the target dtype, a NaN is a
    WeightsError naming the file and key unless allow_nonfinite (load_rows 2: no cast; 13: the
    check inverted; 15: no name)."""
    rows = torch.arange(12.0).reshape(6, 2)
    rows[4, 1] = float("nan")
    loader = bare_loader(set(), set())
    loader.source = SimpleNamespace(load=lambda key, parts, dim, part: rows.chunk(parts, dim)[part],
                                    file_of=lambda key: "model.safetensors")
    target = Target("embed.weight", "embed", (6, 2), torch.bfloat16, -1)
    loader.allow_nonfinite = False
    first = loader.load_rows(target, ["tok_embeddings"], 3, 0)
    assert first.dtype == torch.bfloat16 and first.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    named = r"model\.safetensors: tensor 'tok_embeddings' \(for 'embed\.weight'\)"
    with pytest.raises(WeightsError, match=named):
        loader.load_rows(target, ["tok_embeddings"], 3, 2)
    loader.allow_nonfinite = True
    assert loader.load_rows(target, ["tok_embeddings"], 3, 2).isnan().sum() == 1
