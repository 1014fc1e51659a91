"""The weights loader: translate canonical names, load rank slices lazily, postprocess, strictly.

1. translate: a canonical key is mapped section by section (split on ".") through a key
   map; a list value fans out (qkv -> [q_proj, k_proj, v_proj]), None drops the section,
   and a callable value `(config) -> str | list[str] | None` is called with the model
   config first (a fan-out whose length depends on it, e.g. one source per MoE expert).
   Map priority: customized_key_dict > the layer map matching the module path >
   the architecture's map for the source's HF model_type > its map > DEFAULT_KEY_MAP.
2. load: each source key's slice for (tp_size, tp_dim, tp_rank), from the source. tp_dim
   counts the target's dims; a source with fewer dims (a slice a postprocess stacks into
   leading dims, e.g. one expert of [E, I, H]) is sliced along the same dim counted from
   the end.
3. postprocess: the hook matching the key (glob) turns the slices into target tensor(s).
   A hook marked `@slices_itself` gets the whole source tensors and `tp_rank=` instead,
   for rank layouts a contiguous 1/tp slice cannot express (replicated MQA kv heads).
   A q/k/v fan-out (three sources of `*.attention.qkv.*`) cuts k and v by kv heads
   (`source_part`): the rank's KVH / tp heads, or with KVH < tp the one whole kv head
   its query heads use, replicated on tp / KVH ranks (core.layers.self_attention).
   Expert parallelism: a target whose module declares `shard(name)` overrides (core.layers.moe.ExpertLinear
   under moe_ep_size > 1) carries `experts` (ep, ep_rank): its dim 0 holds experts ep_rank E/ep ..
   (ep_rank + 1) E/ep - 1 of E, so a fan-out of E per-expert sources keeps only those (`sources_of`)
   and one stacked [E, ...] source is cut along dim 0; and `tp_split` (moe_tp, moe_tp_rank), the
   (parts, part) of tp_dim in place of the mapping's (tp_size, tp_rank).
4. strict: every target filled, every source tensor used (or matched by the spec's
   ignored_source_keys), every shape checked, every float value finite (after the cast to
   the target dtype; `allow_nonfinite` turns that check off).
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from bestiary.core.convert.postprocess import identity, slices_itself  # noqa: F401 - plugin API
from bestiary.core.format.checkpoint import check_finite
from bestiary.core.format.errors import WeightsError
from bestiary.core.sources.base import WeightSource
from bestiary.registry.spec import DEFAULT_KEY_MAP, ArchitectureSpec, resolve


@dataclass(frozen=True)
class Target:
    """One tensor a rank's model holds: canonical key, local shape, dtype, slicing dim; under expert
    parallelism the (parts, part) of tp_dim when not the mapping's tp, and the (ep, ep_rank) expert
    group its dim 0 holds (module docstring)."""

    key: str
    module_path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int
    tp_split: tuple[int, int] | None = None
    experts: tuple[int, int] | None = None


def model_targets(model: nn.Module) -> list[Target]:
    """Every parameter and persistent buffer of `model` (built on the meta device) as a Target."""
    targets = []
    for path, module in model.named_modules():
        tp_dim_fn = getattr(module, "tp_dim", None)
        shard_fn = getattr(module, "shard", None)
        persistent = set(module.state_dict(keep_vars=True).keys()) if module._buffers else set()
        tensors = list(module.named_parameters(recurse=False))
        tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if n in persistent]
        for name, tensor in tensors:
            key = f"{path}.{name}" if path else name
            tp_dim = tp_dim_fn(name) if callable(tp_dim_fn) else -1
            shard = shard_fn(name) if callable(shard_fn) else {}
            targets.append(Target(key, path, tuple(tensor.shape), tensor.dtype, tp_dim, **shard))
    return targets


def is_qkv_fanout(target: Target, count: int) -> bool:
    """Whether `target` is a fused attention qkv tensor filled from three sources q, k, v (in that order)."""
    return count == 3 and target.module_path.endswith("attention.qkv")


def nearest(name: str, candidates: list[str], n: int = 3) -> str:
    """' (nearest: a, b)' listing the candidates closest to `name`, or ''."""
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    return f" (nearest: {', '.join(close)})" if close else ""


STREAM_ROWS = 4096  # rows of a large 1-to-1 tensor read, cast and checked at a time (a convert's memory)


def local_experts(target: Target, sources: list[str]) -> list[str]:
    """The sources of `target` this rank reads: a fan-out of E per-expert sources of an expert-parallel
    target keeps experts ep_rank E/ep .. (ep_rank + 1) E/ep - 1 (the target's dim 0 holds E / ep)."""
    if not target.experts or len(sources) != target.shape[0] * target.experts[0]:
        return sources
    ep_rank, local = target.experts[1], target.shape[0]
    return sources[ep_rank * local:(ep_rank + 1) * local]


class WeightsLoader:
    """Fills the targets of a model from a WeightSource through an architecture's key maps."""

    def __init__(
        self,
        source: WeightSource,
        spec: ArchitectureSpec,
        config,
        customized_key_dict: dict | None = None,
        label: str = "",
        source_model_type: str | None = None,
        allow_nonfinite: bool = False,
    ) -> None:
        self.source = source
        self.allow_nonfinite = allow_nonfinite
        self.spec = spec
        self.config = config
        self.customized = dict(customized_key_dict or {})
        self.label = label
        self.source_map = spec.source_key_maps.get(source_model_type or "", {})
        self._source_keys = set(source.keys())
        self._hooks = {pattern: resolve(ref) for pattern, ref in spec.postprocess.items()}
        self.used: set[str] = set()

    # --- 1. translate ------------------------------------------------------------------
    def key_map_for(self, module_path: str) -> dict:
        """Default map < architecture map < its map for the source's model_type < matching layer maps
        < customized_key_dict."""
        merged = dict(DEFAULT_KEY_MAP)
        merged.update(self.spec.key_map)
        merged.update(self.source_map)
        for pattern, layer_map in self.spec.layer_key_maps.items():
            if fnmatch.fnmatchcase(module_path, pattern):
                merged.update(layer_map)
        merged.update(self.customized)
        return merged

    def translate(self, key: str, module_path: str, layer_offset: int = 0) -> list[str]:
        """Source key(s) of canonical `key`; `layers.N` becomes `layers.(N + layer_offset)`."""
        key_map = self.key_map_for(module_path)
        options: list[list[str]] = []
        sections = key.split(".")
        for i, section in enumerate(sections):
            if section.isdigit() and i > 0 and sections[i - 1] == "layers":
                options.append([str(int(section) + layer_offset)])
                continue
            mapped = key_map.get(section, section)
            if callable(mapped):
                mapped = mapped(self.config)
            if mapped is None:
                continue
            options.append(list(mapped) if isinstance(mapped, (list, tuple)) else [mapped])
        return [".".join(p for p in parts if p) for parts in itertools.product(*options)]

    # --- plan: checks before any weight is read ----------------------------------------
    def sources_of(self, target: Target, by_key: dict[str, Target], layer_offset: int,
                   aliases: dict[str, str]) -> list[str]:
        """Source keys of one target (an aliased key, e.g. a tied lm_head, reads its origin's sources)."""
        origin_key, origin_path = target.key, target.module_path
        if target.key in aliases:  # the aliased key may live on another pipeline stage
            origin_key = aliases[target.key]
            origin_path = by_key[origin_key].module_path if origin_key in by_key else origin_key.rpartition(".")[0]
        return local_experts(target, self.translate(origin_key, origin_path, layer_offset))

    def unused_source_keys(self) -> list[str]:
        """Source keys no planned target used and no ignored_source_keys glob matches, sorted."""
        ignored = self.spec.ignored_source_keys
        return sorted(k for k in self._source_keys - self.used
                      if not any(fnmatch.fnmatchcase(k, pattern) for pattern in ignored))

    def plan(self, targets: list[Target], layer_offset: int, aliases: dict[str, str]) -> dict[str, list[str]]:
        """canonical key -> source keys for one rank; a missing source key is an error."""
        by_key = {t.key: t for t in targets}
        plan: dict[str, list[str]] = {}
        for target in targets:
            sources = self.sources_of(target, by_key, layer_offset, aliases)
            missing = [s for s in sources if s not in self._source_keys]
            if missing:
                raise WeightsError(
                    f"{self.label}: tensor {missing[0]!r} (for {target.key!r}) not found in the source"
                    f"{nearest(missing[0], sorted(self._source_keys))}"
                )
            plan[target.key] = sources
            self.used.update(sources)
        return plan

    def check_all_used(self, target_keys: list[str]) -> None:
        """Every source tensor must be consumed by some target (after all ranks were planned)."""
        unused = self.unused_source_keys()
        if unused:
            raise WeightsError(
                f"{self.label}: source tensor {unused[0]!r} is not used by any {self.spec.name} weight"
                f"{nearest(unused[0], sorted(self.used) + target_keys)}"
                + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
            )

    # --- 2 + 3. load and postprocess -----------------------------------------------------
    def prepend_hooks(self, hooks: dict) -> None:
        """Postprocess hooks {glob: fn} tried before the architecture's (core.convert.import_prequantized's in_perm)."""
        self._hooks = {**hooks, **self._hooks}

    def hook_for(self, key: str):
        """The postprocess hook whose glob matches `key` (first match), or identity."""
        for pattern, fn in self._hooks.items():
            if fnmatch.fnmatchcase(key, pattern):
                return fn
        return identity

    def source_tp_dim(self, target: Target, source_key: str, tp_size: int) -> int:
        """Dim of `source_key` to slice: the target's tp_dim, counted from the end when the source
        has fewer dims (one expert's [I, H] of a stacked [E, I, H] target is sliced on dim 0)."""
        if target.tp_dim < 0 or tp_size == 1:
            return target.tp_dim
        extra = len(target.shape) - len(self.source.shape(source_key))
        if extra <= 0:
            return target.tp_dim
        if target.tp_dim < extra:
            raise ValueError(f"tp_dim {target.tp_dim} of {target.key!r} {target.shape} is not in the source")
        return target.tp_dim - extra

    def _slice_dim(self, target: Target, source_key: str, tp_size: int, transposed: bool) -> int:
        """source_tp_dim, with the last two dims swapped for a source the hook transposes (a 2-D (in, out)
        matrix, or stacked experts [E, in, out])."""
        dim = self.source_tp_dim(target, source_key, tp_size)
        n = len(self.source.shape(source_key))
        if transposed and n >= 2 and dim in (n - 2, n - 1):
            return 2 * n - 3 - dim
        return dim

    def source_part(self, target: Target, index: int, count: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """(parts, part) of the `index`-th of `count` sources of `target` that rank `tp_rank` reads.

        A contiguous 1/tp part, except for k and v (index 1, 2) of a q/k/v fan-out with fewer kv
        heads than ranks: the source is cut into its KVH heads and the rank reads the head
        `kv_heads_of_rank` gives it (r KVH // tp), so a kv head is replicated, never split.
        """
        if tp_size == 1 or index == 0 or not is_qkv_fanout(target, count):
            return tp_size, tp_rank
        from bestiary.core.layers.self_attention import kv_heads_of_rank

        c = self.config
        kv = kv_heads_of_rank(c.num_attention_heads, c.num_key_value_heads, tp_size, tp_rank)
        if c.num_key_value_heads % tp_size == 0:
            return tp_size, tp_rank
        return c.num_key_value_heads, kv.start

    def _load_slice(self, target: Target, sources: list[str], index: int, tp_size: int, tp_rank: int,
                    flip: bool) -> torch.Tensor:
        """Rank `tp_rank`'s slice of sources[index] (see source_part); a stacked [E, ...] source of an
        expert-parallel target is cut to the rank's experts first."""
        key = sources[index]
        parts, part = self.source_part(target, index, len(sources), tp_size, tp_rank)
        dim = self._slice_dim(target, key, tp_size, flip)
        if target.experts and len(self.source.shape(key)) == len(target.shape):
            from bestiary.core.sources.base import slice_dim

            ep, ep_rank = target.experts
            mine = self.source.load(key, ep, 0, ep_rank)  # [E / ep, ...]
            return mine[slice_dim(tuple(mine.shape), parts, dim, part)]
        return self.source.load(key, parts, dim, part)

    def _wrong_fanout_part(self, target: Target, sources: list[str], tensors: list[torch.Tensor],
                           tp_size: int, tp_rank: int, flip: bool) -> str | None:
        """For a q/k/v fan-out whose concatenation has the wrong shape: the message naming the
        source whose slice is not the size its heads take (q: H / tp heads, k, v: the rank's kv
        heads), or None when each part is in proportion."""
        if not is_qkv_fanout(target, len(sources)) or target.tp_dim < 0:
            return None
        from bestiary.core.layers.self_attention import kv_heads_of_rank

        c = self.config
        kv = len(kv_heads_of_rank(c.num_attention_heads, c.num_key_value_heads, tp_size, tp_rank))
        heads = [c.num_attention_heads // tp_size, kv, kv]
        total = target.shape[target.tp_dim]
        if total % sum(heads):
            return None
        per_head = total // sum(heads)
        for key, tensor, n in zip(sources, tensors, heads):
            dim = self._slice_dim(target, key, max(tp_size, 2), flip)
            if tensor.dim() <= dim or tensor.shape[dim] != n * per_head:
                return (f"{self.source.file_of(key)}: tensor {key!r} (for {target.key!r}) gives rank {tp_rank} "
                        f"a slice of shape {tuple(tensor.shape)} (source shape {self.source.shape(key)}), "
                        f"expected {n * per_head} along dim {dim} ({n} heads of {per_head})")
        return None

    def row_blocks(self, target: Target, sources: list[str], tp_size: int) -> int:
        """How many equal blocks of rows `target` can be read in, each cast and checked alone (1: whole).

        Only a 2-D target copied from one source of its own shape (the identity hook, unsliced or
        replicated): the embedding and an untied or tied lm_head, whose float32 copies are the largest
        thing a convert holds. Blocks have at most STREAM_ROWS rows and divide the rows evenly."""
        rows = target.shape[0]
        if (len(sources) != 1 or self.hook_for(target.key) is not identity or len(target.shape) != 2
                or rows < 2 * STREAM_ROWS or target.experts or target.tp_split
                or (tp_size > 1 and target.tp_dim >= 0) or tuple(self.source.shape(sources[0])) != target.shape):
            return 1
        return next((n for n in range(-(-rows // STREAM_ROWS), rows // 2 + 1) if rows % n == 0), 1)

    def load_rows(self, target: Target, sources: list[str], blocks: int, block: int) -> torch.Tensor:
        """Block `block` of `blocks` (row_blocks) of `target`: its rows, cast to the target dtype, checked."""
        tensor = self.source.load(sources[0], blocks, 0, block).to(target.dtype).contiguous()
        if not self.allow_nonfinite:
            check_finite(tensor, f"{self.source.file_of(sources[0])}: tensor {sources[0]!r} (for {target.key!r})")
        return tensor

    def load(self, target: Target, sources: list[str], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
        """Target tensor(s) for one canonical key, cast to the target dtype, shapes checked."""
        hook = self.hook_for(target.key)
        whole = getattr(hook, "slices_itself", False)
        flip = getattr(hook, "transposes_source", False)
        tp_size, tp_rank = target.tp_split or (tp_size, tp_rank)  # experts under EP: moe_tp
        try:
            tensors = [self.source.load(s) if whole else self._load_slice(target, sources, i, tp_size, tp_rank, flip)
                       for i, s in enumerate(sources)]
        except ValueError as err:  # a dim that does not split: the source shape is wrong
            raise WeightsError(f"{self.source.file_of(sources[0])}: {sources[0]!r} for {target.key!r}: {err}") from None
        try:
            if whole:
                out = hook(target.key, tensors, self.config, tp_rank=tp_rank)
            else:
                out = hook(target.key, tensors, self.config)
        except WeightsError:
            raise
        except (ValueError, RuntimeError) as err:
            raise WeightsError(f"{self.source.file_of(sources[0])}: postprocess of {target.key!r} failed: {err}") from None
        result = {}
        for key, tensor in out.items():
            if key == target.key and tuple(tensor.shape) != target.shape:
                wrong = None if whole else self._wrong_fanout_part(target, sources, tensors, tp_size, tp_rank, flip)
                if wrong:
                    raise WeightsError(wrong)
                raise WeightsError(
                    f"{self.source.file_of(sources[0])}: tensor {sources[0]!r} for {key!r} has shape "
                    f"{tuple(tensor.shape)} (from source shape {self.source.shape(sources[0])}), "
                    f"expected {target.shape}"
                )
            result[key] = tensor.to(target.dtype).contiguous()
            if not self.allow_nonfinite:
                check_finite(result[key], f"{self.source.file_of(sources[0])}: tensor {sources[0]!r} (for {key!r})")
        return result
