"""An HF PEFT adapter directory -> a `LoraAdapter` for one model rank.

The adapter's tensors are `base_model.model.<HF module path>.lora_{A,B}.weight`, A [r, in]
and B [out, r]. A module path is `<layers>.<i>.<...>.<name>` (with `experts.<e>.` for a MoE
expert): `<layers>` must be one of the architecture's `spec.lora.hf_layers` and `<name>` one
of its `spec.lora.hf_modules`, which names the LoRA module(s) it feeds (core.lora.modules).
Every target is checked against the architecture before a weight is read.

Each LoRA module becomes a `LoraPiece` on a canonical linear of this rank (key: the linear's
module path, and the expert or -1):

    whole   B through the canonical weight's postprocess (a fused HF source's row order;
            this rank's rows), A unchanged (a row-parallel linear: this rank's columns)
    q/k/v   B placed at its rows of a whole [Q; K; V] and cut to this rank's rows as the
            weight is (qkv_rank_slice: kv rows replicated when tp > KVH)
    expert  B / A cut for the rank like the stacked expert weight

so that every piece reads y += s B (A x) with B [out_local, r] and A [r, in_local].
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.layers.self_attention import qkv_rank_slice
from bestiary.core.lora.modules import LANDINGS, Landing
from bestiary.core.lora.peft_config import PeftLoraConfig, read_peft_config
from bestiary.registry import ArchitectureSpec, Registry, default_registry, resolve

_uids = itertools.count()
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_PATH = re.compile(r"^(?P<layers>.+?)\.(?P<layer>\d+)\.(?P<rest>.+)$")


@dataclass
class LoraPiece:
    """One LoRA module on one linear: delta = scaling * B (A x), A [r, in_local], B [out_local, r]."""

    module: str  # the LoRA module name (attn_q, ...)
    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    """A loaded adapter: its pieces per (canonical linear path, expert or -1) of this rank."""

    name: str
    path: Path
    pieces: dict[tuple[str, int], list[LoraPiece]] = field(default_factory=dict)
    uid: int = field(default_factory=lambda: next(_uids))  # this placement (a re-read adapter gets another)
    source: LoraSource | None = field(default=None, repr=False)  # what it was placed from (sent to other ranks)

    @property
    def modules(self) -> list[str]:
        """The LoRA module names it adapts, sorted."""
        return sorted({p.module for ps in self.pieces.values() for p in ps})


@dataclass(frozen=True)
class _Target:
    """A PEFT module path parsed: layer i, expert e (-1), HF module name."""

    path: str
    layers: str
    layer: int
    expert: int
    hf_name: str


def _weight_file(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise BestiaryError(f"{directory}: no {' or '.join(WEIGHT_FILES)} (the adapter's weights)")


def _tensor_names(path: Path) -> list[str]:
    """Names of the tensors of an adapter file, without reading any weight."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        return list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception as err:  # noqa: BLE001 - a truncated / foreign file: one line naming it
        raise BestiaryError(f"{path}: not a readable adapter weight file ({str(err).splitlines()[0]})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _owners(name: str, registry: Registry, attr: str) -> list[str]:
    """Architectures whose LoRA data lists HF module / layer path `name` (attr: hf_modules or hf_layers)."""
    return sorted(s.name for s in registry.specs.values() if name in getattr(s.lora, attr))


def _check_target_names(config: PeftLoraConfig, spec: ArchitectureSpec, registry: Registry, source: Path) -> None:
    """Each target_modules name (list form) is an HF module of this architecture, else one line."""
    if not isinstance(config.target_modules, list):
        return
    known = list(spec.lora.hf_modules)
    for target in config.target_modules:
        name = target.rsplit(".", 1)[-1]
        if name in known:
            continue
        raise BestiaryError(_unknown(name, spec, registry, f"{source}: target_modules"))


def _unknown(name: str, spec: ArchitectureSpec, registry: Registry, where: str) -> str:
    others = [o for o in _owners(name, registry, "hf_modules") if o != spec.name]
    if others:
        return (f"{where}: {name!r} is a module of {', '.join(others)}: this adapter was made for another "
                f"architecture than {spec.name}")
    known = list(spec.lora.hf_modules)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    near = f"; nearest valid module: {close[0]!r}" if close else ""
    return (f"{where}: unknown target module {name!r} for {spec.name}{near} "
            f"(valid: {', '.join(known) or 'none: this architecture takes no LoRA'})")


def _parse_targets(names: list[str], spec: ArchitectureSpec, registry: Registry, file: Path,
                   num_layers: int | None) -> dict[str, _Target]:
    """PEFT module path -> _Target for every lora_A/lora_B tensor name (refusing the rest)."""
    targets: dict[str, _Target] = {}
    for key in names:
        m = _KEY.match(key)
        if m is None:
            why = "DoRA magnitudes" if "lora_magnitude" in key else "an embedding adapter" if "embedding" in key else None
            what = f" ({why} are not supported)" if why else "; expected <module>.lora_A.weight / .lora_B.weight"
            raise BestiaryError(f"{file}: tensor {key!r} is not a LoRA A/B weight{what}")
        path = m["module"]
        if path in targets:
            continue
        parts = _PATH.match(path)
        name = path.rsplit(".", 1)[-1]
        if parts is None:
            raise BestiaryError(_unknown(name, spec, registry, f"{file}: {key}"))
        if parts["layers"] not in spec.lora.hf_layers:
            others = [o for o in _owners(parts["layers"], registry, "hf_layers") if o != spec.name]
            whose = f" (the layout of {', '.join(others)})" if others else ""
            raise BestiaryError(
                f"{file}: {key}: layers under {parts['layers']!r}{whose}, but {spec.name} has them under "
                f"{' or '.join(map(repr, spec.lora.hf_layers))}: this adapter was made for another architecture")
        if name not in spec.lora.hf_modules:
            raise BestiaryError(_unknown(name, spec, registry, f"{file}: {key}"))
        layer = int(parts["layer"])
        if num_layers is not None and layer >= num_layers:
            raise BestiaryError(f"{file}: {key}: layer {layer}, but the base model has {num_layers} layers")
        expert = re.search(r"(?:^|\.)(\d+)\.", parts["rest"])
        targets[path] = _Target(path, parts["layers"], layer, int(expert[1]) if expert else -1, name)
    return targets


@dataclass
class ModuleWeights:
    """One adapted HF module of one layer as its source holds it (all ranks, the HF row order):
    delta = scaling * B (A x), A [r, in], B [out, r], feeding LoRA module(s) `modules`."""

    modules: tuple[str, ...]
    layer: int
    expert: int  # -1: not a MoE expert
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    where: str  # names the source (file and tensor, or row) in errors
    hf_path: str = ""  # the PEFT module path, when it came from one

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraSource:
    """An adapter as read, before it is placed on a model rank (what the host cache holds)."""

    name: str
    path: Path | None
    modules: list[ModuleWeights]

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules)

    def to(self, dtype: torch.dtype) -> LoraSource:
        """The same adapter with A and B in `dtype`."""
        mods = [ModuleWeights(m.modules, m.layer, m.expert, m.a.to(dtype), m.b.to(dtype), m.scaling, m.where, m.hf_path)
                for m in self.modules]
        return LoraSource(self.name, self.path, mods)


def read_peft(directory: str | Path, spec: ArchitectureSpec, registry: Registry | None = None,
              num_layers: int | None = None, name: str | None = None) -> LoraSource:
    """The HF PEFT adapter in `directory` for architecture `spec` (targets checked before any weight
    is read; layers checked against `num_layers` when given); errors are one line."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BestiaryError(f"{directory}: no such adapter directory")
    registry = registry or default_registry()
    config = read_peft_config(directory)
    _check_target_names(config, spec, registry, directory / "adapter_config.json")
    file = _weight_file(directory)
    targets = _parse_targets(_tensor_names(file), spec, registry, file, num_layers)
    if not targets:
        raise BestiaryError(f"{file}: no LoRA tensors (<module>.lora_A.weight / .lora_B.weight)")
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _read_tensors(file).items():
        m = _KEY.match(key)
        assert m is not None  # the same names _parse_targets matched (it refuses any other)
        by_module.setdefault(m["module"], {})[m["ab"]] = t
    modules = []
    for path, target in targets.items():
        pair = by_module[path]
        missing = {"A", "B"} - set(pair)
        if missing:
            raise BestiaryError(f"{file}: {path} has no lora_{missing.pop()}.weight")
        a, b, where = pair["A"], pair["B"], f"{file}: {path}"
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise BestiaryError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
        if a.shape[0] != config.rank_of(path):
            raise BestiaryError(f"{where}: lora_A has rank {a.shape[0]}, adapter_config.json says r = {config.rank_of(path)}")
        value = spec.lora.hf_modules[target.hf_name]
        fed = (value,) if isinstance(value, str) else tuple(value)
        modules.append(ModuleWeights(fed, target.layer, target.expert, a, b, config.scaling_of(path), where, path))
    return LoraSource(name or directory.name, directory, modules)


def load_adapter(directory: str | Path, model, name: str | None = None, registry: Registry | None = None) -> LoraAdapter:
    """Read the PEFT adapter in `directory` for `model` (a DecoderLM rank); errors are one line."""
    registry = registry or default_registry()
    spec = registry.get(model.config.architecture)
    source = read_peft(directory, spec, registry, model.config.num_hidden_layers, name)
    return place(source, model, registry)


def place(source: LoraSource, model, registry: Registry | None = None) -> LoraAdapter:
    """`source` on this model rank: each module's (A, B) as this rank's pieces (module docstring)."""
    spec = (registry or default_registry()).get(model.config.architecture)
    adapter = LoraAdapter(source.name, source.path or Path(source.name), source=source)
    for weights in source.modules:
        if weights.layer >= model.config.num_hidden_layers:
            raise BestiaryError(f"{weights.where}: layer {weights.layer}, but the base model has "
                                f"{model.config.num_hidden_layers} layers")
        _add_pieces(adapter, weights, spec, model)
    return adapter


def _add_pieces(adapter: LoraAdapter, weights: ModuleWeights, spec: ArchitectureSpec, model) -> None:
    """The pieces one source module (A [r, in], B [out, r]) gives this rank."""
    local = weights.layer - model.layer_offset
    if not 0 <= local < len(model.transformer.layers):
        return  # another pipeline stage's layer
    for module in weights.modules:
        landing = LANDINGS[module]
        linear_path = f"transformer.layers.{local}.{landing.section}"
        try:
            linear = model.get_submodule(linear_path)
        except AttributeError:
            raise BestiaryError(f"{weights.where}: LoRA module {module} needs {linear_path}, "
                                f"which {spec.name} does not have") from None
        dtype = model.dtype
        a_local, b_local = _place(landing, weights.a.to(dtype), weights.b.to(dtype), linear, model, spec, weights)
        expert = weights.expert if landing.kind == "expert" else -1
        piece = LoraPiece(module, a_local.contiguous(), b_local.contiguous(), weights.scaling)
        adapter.pieces.setdefault((linear_path, expert), []).append(piece)


def _mismatch(where: str, what: str, got: tuple, want: tuple) -> BestiaryError:
    return BestiaryError(f"{where}: {what} has shape {got}, the base model needs {want}")


def _place(landing: Landing, a: torch.Tensor, b: torch.Tensor, linear, model, spec: ArchitectureSpec,
           target: ModuleWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in_local], B [out_local, r]) of a LoRA module on `linear` of this rank."""
    from bestiary.core.layers.linear import Parallel

    cfg, r, where = model.config, a.shape[0], target.where
    tp, tp_rank = model.tp_size, model.tp_rank
    row_parallel = linear.parallel == Parallel.ROW
    if landing.kind == "expert":
        if getattr(linear, "ep_size", 1) > 1:
            raise BestiaryError(f"{where}: LoRA on MoE experts is not supported with expert parallelism "
                                f"(moe_ep_size {linear.ep_size}); convert the base model with --moe_ep_size 1")
        if not 0 <= target.expert < linear.num_experts:
            raise BestiaryError(f"{where}: expert {target.expert}, but the base model has {linear.num_experts}")
        _, out_local, in_local = linear.weight.shape
        full_in = in_local * (tp if row_parallel else 1)
        full_out = out_local * (tp if linear.parallel == Parallel.COLUMN else 1)
        if a.shape[1] != full_in or b.shape[0] != full_out:
            raise _mismatch(where, "lora_A / lora_B", (tuple(a.shape), tuple(b.shape)), ((r, full_in), (full_out, r)))
    elif a.shape[1] != linear.in_features:
        raise _mismatch(where, "lora_A", tuple(a.shape), (r, linear.in_features))
    if landing.kind in ("q", "k", "v"):
        h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        rows = _qkv_rows(linear, model)
        d = rows["q"] // h
        if b.shape[0] != rows[landing.kind]:
            raise _mismatch(where, "lora_B", tuple(b.shape), (rows[landing.kind], r))
        whole = torch.zeros((h + 2 * kvh) * d, r, dtype=b.dtype)
        start = {"q": 0, "k": h * d, "v": (h + kvh) * d}[landing.kind]
        whole[start : start + b.shape[0]] = b
        b = qkv_rank_slice(whole, h, kvh, d, tp, tp_rank)
    elif landing.kind == "whole":
        b = _postprocess_rows(f"{linear.name}.weight", b, model, spec, linear.parallel == Parallel.COLUMN, where)
        out_local = linear.out_features // tp if linear.parallel == Parallel.COLUMN else linear.out_features
        if b.shape[0] != out_local:
            raise _mismatch(where, "lora_B (as this rank's rows)", tuple(b.shape), (out_local, r))
    elif linear.parallel == Parallel.COLUMN and tp > 1:  # expert, column-parallel: this rank's rows
        b = b.chunk(tp, dim=0)[tp_rank]
    if row_parallel and tp > 1:
        a = a.chunk(tp, dim=1)[tp_rank]
    return a, b


def _qkv_rows(linear, model) -> dict[str, int]:
    """Full rows of q, k and v in a fused attention.qkv: H*d, KVH*d, KVH*d."""
    d = model.get_submodule(linear.name.rsplit(".", 1)[0]).head_dim
    h, kvh = model.config.num_attention_heads, model.config.num_key_value_heads
    return {"q": h * d, "k": kvh * d, "v": kvh * d}


def module_dims(model, module: str, layer: int) -> tuple[int, int]:
    """(Hi, Ho): the full (all ranks) input and output sizes of LoRA module `module` of `layer`
    (a layer of another pipeline stage: this stage's first layer, the layers being alike)."""
    landing = LANDINGS[module]
    local = layer - model.layer_offset
    if layer >= model.config.num_hidden_layers:
        raise BestiaryError(f"LoRA module {module}: layer {layer}, but the base model has "
                            f"{model.config.num_hidden_layers} layers")
    path = f"transformer.layers.{local if 0 <= local < len(model.transformer.layers) else 0}.{landing.section}"
    try:
        linear = model.get_submodule(path)
    except AttributeError:
        raise BestiaryError(f"LoRA module {module} needs {landing.section}, which "
                            f"{model.config.architecture} does not have") from None
    if landing.kind in ("q", "k", "v"):
        return linear.in_features, _qkv_rows(linear, model)[landing.kind]
    return linear.in_features, linear.out_features


def _postprocess_rows(key: str, b: torch.Tensor, model, spec: ArchitectureSpec, column: bool, where: str) -> torch.Tensor:
    """B's rows in the canonical weight's order, for this rank: the architecture's postprocess of
    `key` (a fused source's row order, e.g. Falcon qkv or ChatGLM2's gate/up halves) applied to B."""
    hook_ref = next((ref for pattern, ref in spec.postprocess.items() if fnmatch.fnmatchcase(key, pattern)), None)
    hook = resolve(hook_ref) if hook_ref else None
    tp, tp_rank = model.tp_size, model.tp_rank
    if hook is not None and getattr(hook, "transposes_source", False):
        hook = None  # the source weight is stored (in, out); PEFT's lora_B is (out, r) all the same
    try:
        if hook is not None and getattr(hook, "slices_itself", False):
            return hook(key, [b], model.config, tp_rank=tp_rank)[key]
        if column and tp > 1:
            b = b.chunk(tp, dim=0)[tp_rank]
        return hook(key, [b], model.config)[key] if hook is not None else b
    except (ValueError, RuntimeError) as err:
        raise BestiaryError(f"{where}: lora_B of shape {tuple(b.shape)} does not fit {key} ({err})") from None
