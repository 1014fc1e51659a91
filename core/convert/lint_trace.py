"""Where a converted model departs from its transformers reference, and which config field explains it
(the linter's step 5, `bestiary convert --dry_run`; used by core.convert.lint).

    departure   the first decoder layer i whose output misses the reference's hidden state i + 1
                (the parity bound 1e-4 * max(1, max|ref|)), then which of its sub-modules departs
                first: our layer's `attention` / `mlp` outputs against the reference layer's
                attention / MLP children (by name: *attn* / *attention*, *mlp* / *feed_forward*)
    suspects    config fields whose usual mistakes are tried one at a time on the same weights
                (the rotary fraction, neox vs gptj interleave, each boolean field of the family flipped);
                one that makes layer i (or the logits) match is named with the layer
    same-named  a family field whose HF config.json has a key of the same name with another value
                (a reader that dropped or overrode it)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bestiary.core.format.config import PretrainedConfig
from bestiary.core.runtime.model import DecoderLM

ROTARY_FRACTIONS = (1.0, 0.5, 0.25)
ROPE_STYLES = {"rope_gpt_neox": "rope_gptj", "rope_gptj": "rope_gpt_neox"}
ATTENTION_NAMES, MLP_NAMES = ("self_attn", "self_attention", "attention", "attn"), ("mlp", "feed_forward", "ffn")


def close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """max|ours - ref| <= 1e-4 * max(1, max|ref|), the parity bound."""
    return ours.shape == ref.shape and (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def first_departure(layers: list[torch.Tensor], hidden: list[torch.Tensor]) -> int | None:
    """The first i whose layer output [T, H] misses the reference's hidden state i + 1 (the last
    layer is judged by the logits, as the reference's last hidden state may be normed), or None."""
    for i in range(len(layers) - 1):
        if not close(layers[i], hidden[i + 1]):
            return i
    return None


def reference_layers(hf: nn.Module, count: int) -> nn.ModuleList | None:
    """The reference's decoder layers: its first ModuleList of `count` modules."""
    return next((m for m in hf.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)


def child_named(layer: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The first direct child of `layer` whose name is one of `names` (in that order of preference)."""
    children = dict(layer.named_children())
    return next((children[n] for n in names if n in children), None)


def capture(modules: list[nn.Module | None], run: Callable[[], Any]) -> list[torch.Tensor | None]:
    """The first output [T, H] of each of `modules` (a tuple's first element) during one `run()`."""
    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    def keep(got: list[torch.Tensor]) -> Callable:
        return lambda _m, _i, out: got.append(out[0] if isinstance(out, tuple) else out)

    handles = [m.register_forward_hook(keep(got)) for m, got in zip(modules, seen) if m is not None]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return [got[0].detach().float().reshape(-1, got[0].shape[-1]) if got else None for got in seen]


def departing_part(ours: DecoderLM, hf: nn.Module, i: int, run_ours: Callable[[], Any],
                   run_hf: Callable[[], Any]) -> str:
    """Which part of layer i departs first: "attention" when our attention output misses the reference's,
    "mlp (attention matches)" when only the MLP's does, "after attention and mlp (norms or residuals)"
    when both match, "" when the reference has no recognisable children."""
    theirs = reference_layers(hf, len(ours.transformer.layers))
    if theirs is None:
        return ""
    refs = capture([child_named(theirs[i], ATTENTION_NAMES), child_named(theirs[i], MLP_NAMES)], run_hf)
    layer = ours.transformer.layers[i]
    outs = capture([getattr(layer, "attention", None), getattr(layer, "mlp", None)], run_ours)
    pairs = [(out, ref) for out, ref in zip(outs, refs) if out is not None and ref is not None]
    if len(pairs) < 2:  # a part without output (or without a counterpart in the reference)
        return ""
    attention_ok, mlp_ok = (close(out, ref) for out, ref in pairs)
    if not attention_ok:
        return "attention"
    return "mlp (attention matches)" if not mlp_ok else "after attention and mlp (norms or residuals)"


def config_suspects(config: PretrainedConfig, base_fields: set[str]) -> list[tuple[str, Any]]:
    """(field, value) trials: other rotary fractions, the other rope interleave, each boolean field the
    family adds (those not in `base_fields`) flipped."""
    out: list[tuple[str, Any]] = []
    fields = type(config).model_fields
    if "rotary_pct" in fields:
        current = getattr(config, "rotary_pct", None)  # a field of this config class (DecoderConfig's, mostly)
        out += [("rotary_pct", p) for p in ROTARY_FRACTIONS if p != current]
    if config.position_embedding_type in ROPE_STYLES and "position_embedding_type" in fields:
        out.append(("position_embedding_type", ROPE_STYLES[config.position_embedding_type]))
    for name, field in fields.items():
        if name not in base_fields and field.annotation is bool:
            out.append((name, not getattr(config, name)))
    return out


def same_named_mismatches(config: PretrainedConfig, hf_config: dict, base_fields: set[str]) -> list[str]:
    """"field: ..." for each family field (not in `base_fields`) whose same-named HF config.json key
    holds another value."""
    out = []
    for name in type(config).model_fields:
        if name in base_fields or hf_config.get(name) is None:
            continue
        ours, theirs = getattr(config, name), hf_config[name]
        if ours != theirs:  # 1 == 1.0: an int in config.json for a float field is no mismatch
            out.append(f"{name}: the config has {ours!r} but the source's config.json says {theirs!r} "
                       "(a reader that drops or overrides it?)")
    return out
