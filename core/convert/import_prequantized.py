"""Importing pre-quantized HF AWQ / GPTQ checkpoints at `bestiary convert`.

A source whose config.json has a `quantization_config` (or whose directory has AutoGPTQ's
`quantize_config.json`) with quant_method awq or gptq converts to quant_algo W4A16_AWQ /
W4A16_GPTQ in the canonical int4 layout (core.format.packing; word layouts in
core.quant.hf_formats):

1. `PrequantizedWeights` wraps the source: each layer with a `qweight` is presented under
   canonical tensor names, unpacked on read: `{layer}.weight` uint8 [N, K/2],
   `.weights_scaling_factor` [N, groups], `.zeros` [N, groups] (and GPTQ's `.in_perm` int32
   [K]); its qweight / qzeros / scales / g_idx are not listed. Shapes are checked when the
   source is opened, so a malformed layer is refused before anything is written.
2. The loader then runs unchanged: the architecture's key map translates names, its
   postprocess hooks build fused tensors from the unpacked ones (a qkv is [Q; K; V] rows
   of weight, scales and zeros: concatenation along the out dim), and tensor-parallel slices
   are cut from the canonical layout (weight and scales along N for column-parallel layers,
   along K and the groups for row-parallel ones). `in_perm` of a fused layer must be the same
   for every part (`same_permutation`).
3. Layers the source holds in float (typically lm_head) become `exclude_modules`.

FastLLM `.flm` sources (core.sources.flm_source) say quant_method "fastllm": their int8 / int4
codes land as W8A16 / W4A16 with zero points through the same steps (`prequantized_weights`).

Act-order (GPTQ desc_act): the canonical weight is permuted to group-contiguous features and
the layer multiplies x[..., in_perm]. `in_perm` holds indices into the layer's full input
features; a row-parallel layer on several ranks can take act-order only when every rank's
features stay on that rank, else the convert is refused (use --tp_size 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from bestiary.core.format import packing
from bestiary.core.format.config import Mapping, PretrainedConfig, QuantConfig, read_json
from bestiary.core.format.errors import BestiaryError, ConfigError, WeightsError
from bestiary.core.quant import hf_formats
from bestiary.core.sources.base import ModelSource, WeightSource, slice_dim

SOURCE_PARTS = ("qweight", "qzeros", "scales", "g_idx")
ALGOS = {"awq": "W4A16_AWQ", "gptq": "W4A16_GPTQ"}
PERM_NAME = "in_perm"


@dataclass(frozen=True)
class HFQuant:
    """What a source's quantization_config says, checked."""

    method: str  # "awq" | "gptq"
    group_size: int  # the source's; -1: one group over all in-features
    zero_offset: int  # added to stored zero points (GPTQ v1 checkpoints: 1)
    origin: str  # the file it was read from, for messages
    bits: int = 4  # fastllm: 8 (W8A16) or 4 (W4A16)
    activation_group: int | None = None  # fastllm: FastLLM's input quantization group (None: per row)
    activation_quant: str | None = None  # fastllm: quantization.activation_quant of the converted model

    @property
    def algo(self) -> str:
        if self.method == "fastllm":
            return "W8A16" if self.bits == 8 else "W4A16"
        return ALGOS[self.method]


def _field(qc: dict, origin: str, name: str, expected, default=None):
    value = qc.get(name, default)
    if value not in expected:
        shown = ", ".join(map(str, expected))
        raise ConfigError(f"{origin}: quantization_config.{name} {value!r}: expected {shown} "
                          f"(bestiary imports 4-bit AWQ gemm and GPTQ checkpoints)")
    return value


def read_hf_quant(source: ModelSource) -> HFQuant | None:
    """The source's AWQ/GPTQ quantization (None: a float source); ConfigError names a bad field."""
    qc = source.hf_config.get("quantization_config")
    directory = source.path if source.path.is_dir() else source.path.parent
    origin = str(directory / "config.json")
    if qc is None and (directory / "quantize_config.json").is_file():
        origin = str(directory / "quantize_config.json")
        qc = {"quant_method": "gptq", **read_json(directory / "quantize_config.json")}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fastllm" and source.format == "flm":  # core.sources.flm_source: codes read as they are
        return HFQuant("fastllm", int(qc["group_size"]), 0, str(source.path), int(qc["bits"]),
                       qc.get("activation_group"), qc.get("activation_quant"))
    if method not in ALGOS:
        raise ConfigError(f"{origin}: quantization_config.quant_method {method!r}: expected awq or gptq "
                          f"(the pre-quantized formats bestiary imports)")
    _field(qc, origin, "bits", (4,))
    group = qc.get("group_size", 128)
    try:
        hf_formats.canonical_group(group if isinstance(group, int) else 0)
    except ValueError:
        raise ConfigError(f"{origin}: quantization_config.group_size {group!r}: expected -1 or a multiple of 32") from None
    if method == "awq":
        _field(qc, origin, "zero_point", (True,), True)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{origin}: quantization_config.version {version!r}: expected gemm "
                              f"(the AWQ layout transformers saves)")
        return HFQuant("awq", group, 0, origin)
    fmt = _field(qc, origin, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
    return HFQuant("gptq", group, 1 if fmt == "gptq" else 0, origin)


def import_quant_config(hq: HFQuant, requested: QuantConfig | None) -> QuantConfig:
    """The checkpoint's quantization section for an imported source (KV cache flags kept)."""
    if requested is not None and requested.quant_algo is not None:
        raise ConfigError(f"--use_weight_only: {hq.origin} is already quantized ({hq.method}); "
                          f"convert it without weight quantization flags")
    kv = requested.kv_cache_quant_algo if requested is not None else None
    group = hq.group_size if hq.method == "fastllm" else hf_formats.canonical_group(hq.group_size)
    if hq.method == "fastllm" and hq.activation_quant:  # run as FastLLM does: its matmuls quantize inputs
        return QuantConfig(quant_algo=hq.algo, kv_cache_quant_algo=kv, group_size=group, has_zero_point=True,
                           activation_quant=hq.activation_quant, activation_group_size=hq.activation_group)
    return QuantConfig(quant_algo=hq.algo, kv_cache_quant_algo=kv, group_size=group, has_zero_point=True)


def prequantized_weights(source: ModelSource, hq: HFQuant) -> WeightSource:
    """The source's weights with its quantized layers under canonical names (`quantized_layers`: their
    source names): AWQ / GPTQ unpacked here, FastLLM .flm codes by core.sources.flm_source."""
    if hq.method == "fastllm":
        from bestiary.core.sources.flm_source import FlmWeights

        assert isinstance(source.weights, FlmWeights), "read_hf_quant says fastllm for .flm sources only"
        return source.weights.prequantized(hq.bits, hq.group_size)
    return PrequantizedWeights(source.weights, hq)


# --- the source wrapper ----------------------------------------------------------------------
class PrequantizedWeights:
    """WeightSource over an AWQ/GPTQ source: quantized layers under canonical names (module doc)."""

    def __init__(self, inner: WeightSource, hq: HFQuant) -> None:
        self.inner, self.hq = inner, hq
        raw = self._raw = set(inner.keys())
        self.layers = sorted(k[: -len(".qweight")] for k in raw if k.endswith(".qweight"))
        self.quantized_layers = set(self.layers)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._owner: dict[str, str] = {}
        for layer in self.layers:
            for name, shape in self._layer_shapes(layer, raw).items():
                self._shapes[f"{layer}.{name}"] = shape
                self._owner[f"{layer}.{name}"] = layer
        hidden = {f"{layer}.{part}" for layer in self.layers for part in SOURCE_PARTS}
        # inner is a WeightSource (keys() is its method), not a dict
        self._keys = [k for k in inner.keys() if k not in hidden] + list(self._shapes)  # noqa: SIM118
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def _layer_shapes(self, layer: str, raw: set[str]) -> dict[str, tuple[int, ...]]:
        """Canonical shapes of `layer`, from the source shapes (WeightsError on a malformed layer)."""
        file = self.inner.file_of(f"{layer}.qweight")
        for part in ("qzeros", "scales"):
            if f"{layer}.{part}" not in raw:
                raise WeightsError(f"{file}: {layer}.{part} is missing ({self.hq.method} layers need qweight, "
                                   f"qzeros and scales)")
        qw, qz, sc = (tuple(self.inner.shape(f"{layer}.{p}")) for p in ("qweight", "qzeros", "scales"))
        if len(sc) != 2:
            raise WeightsError(f"{file}: {layer}.scales has shape {list(sc)}, expected [groups, out_features]")
        groups, n = sc
        if self.hq.method == "awq":
            k, expected, layout = (qw[0] if qw else 0), (qw[0] if qw else 0, n // 8), "[in, out/8]"
        else:
            k, expected, layout = 8 * (qw[0] if qw else 0), (qw[0] if qw else 0, n), "[in/8, out]"
        if len(qw) != 2 or n % 8 or qw != expected:
            raise WeightsError(f"{file}: {layer}.qweight has shape {list(qw)}, expected {layout} = {list(expected)} "
                               f"({self.hq.method}, {layer}.scales is {list(sc)})")
        g = k if self.hq.group_size == -1 else self.hq.group_size
        if groups != -(-k // g) or qz != (groups, n // 8):
            raise WeightsError(f"{file}: {layer}.scales {list(sc)} / .qzeros {list(qz)} do not match {k} input "
                               f"features in groups of {g}: expected [{-(-k // g)}, {n}] / [{-(-k // g)}, {n // 8}]")
        if k % 2:
            raise WeightsError(f"{file}: {layer} has {k} input features; int4 packing needs an even number")
        if f"{layer}.g_idx" in raw and tuple(self.inner.shape(f"{layer}.g_idx")) != (k,):
            raise WeightsError(f"{file}: {layer}.g_idx has shape {list(self.inner.shape(f'{layer}.g_idx'))}, "
                               f"expected [{k}]")
        groups_c = -(-k // hf_formats.canonical_group(self.hq.group_size))
        shapes: dict[str, tuple[int, ...]] = {"weight": (n, k // 2), "weights_scaling_factor": (n, groups_c),
                                              "zeros": (n, groups_c)}
        if self.hq.method == "gptq":
            shapes[PERM_NAME] = (k,)
        return shapes

    # WeightSource
    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key] if key in self._shapes else self.inner.shape(key)

    def file_of(self, key: str) -> str:
        return self.inner.file_of(f"{self._owner[key]}.qweight" if key in self._owner else key)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        if key not in self._owner:
            return self.inner.load(key, tp_size, tp_dim, tp_rank)
        layer = self._owner[key]
        name = key[len(layer) + 1:]
        full = self.perm(layer) if name == PERM_NAME else self.canonical(layer)[name]
        return full[slice_dim(tuple(full.shape), tp_size, tp_dim, tp_rank)]

    # unpacking
    def _words(self, layer: str, part: str) -> torch.Tensor:
        t = self.inner.load(f"{layer}.{part}")
        if t.dtype != torch.int32:
            raise WeightsError(f"{self.inner.file_of(f'{layer}.{part}')}: {layer}.{part} is {t.dtype}, "
                               f"expected int32 words of 4-bit codes")
        return t

    def perm(self, layer: str) -> torch.Tensor:
        """int32 [K]: canonical in-feature j is source in-feature perm[j] (identity without act-order)."""
        k = self._shapes[f"{layer}.weight"][1] * 2
        if f"{layer}.g_idx" not in self._raw:
            return torch.arange(k, dtype=torch.int32)
        try:
            return hf_formats.act_order_perm(self.inner.load(f"{layer}.g_idx"), self.hq.group_size)
        except ValueError as err:
            raise WeightsError(f"{self.inner.file_of(f'{layer}.g_idx')}: {layer}.g_idx: {err}") from None

    def canonical(self, layer: str) -> dict[str, torch.Tensor]:
        """{weight, weights_scaling_factor, zeros[, in_perm]} of `layer` (the last layer is cached)."""
        if self._cached is not None and self._cached[0] == layer:
            return self._cached[1]
        qweight, qzeros = self._words(layer, "qweight"), self._words(layer, "qzeros")
        scales = self.inner.load(f"{layer}.scales")
        if self.hq.method == "awq":
            q, z = hf_formats.unpack_awq(qweight), hf_formats.unpack_awq(qzeros)
            perm = torch.arange(q.shape[0], dtype=torch.int32)
        else:
            q, z = hf_formats.unpack_gptq_qweight(qweight), hf_formats.unpack_gptq_qzeros(qzeros)
            perm = self.perm(layer)
        z = z.to(torch.float32) + self.hq.zero_offset
        c = hf_formats.to_canonical(q, z, scales, perm, self.hq.group_size)
        out = {"weight": packing.pack_int4(c.codes), "weights_scaling_factor": c.scales, "zeros": c.zeros}
        if self.hq.method == "gptq":
            out[PERM_NAME] = c.perm
        self._cached = (layer, out)
        return out


# --- hooks and checks around the loader ------------------------------------------------------
def same_permutation(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """in_perm of a layer fused from several source layers (q, k, v): they must all be equal."""
    for other in tensors[1:]:
        if not torch.equal(other, tensors[0]):
            raise ValueError(f"{key}: the fused source layers have different act-order g_idx")
    return {key: tensors[0]}


def _compress(names: list[str], all_names: list[str]) -> list[str]:
    """exclude_modules patterns for `names`: a `layers.*` glob where every layer's module is listed."""
    listed, out = set(names), []
    for name in names:
        pattern = re.sub(r"\.layers\.\d+\.", ".layers.*.", name)
        peers = [n for n in all_names if re.sub(r"\.layers\.\d+\.", ".layers.*.", n) == pattern]
        entry = pattern if pattern != name and all(p in listed for p in peers) else name
        if entry not in out:
            out.append(entry)
    return out


def float_layers(loader, model_class, config: PretrainedConfig) -> list[str]:
    """exclude_modules for the Linears the source holds in float (lm_head, typically).

    A fused layer whose parts are partly quantized is refused."""
    single = config.model_copy(update={"mapping": Mapping()})  # one rank: every layer
    with torch.device("meta"):
        model = model_class(single, 0, device="meta")
    from bestiary.core.quant.apply import quantized_linears

    aliases = model.source_aliases()
    held = loader.source.quantized_layers
    names, floats = [], []
    for path in quantized_linears(model):
        key = aliases.get(f"{path}.weight", f"{path}.weight")
        sources = loader.translate(key, key.rpartition(".")[0])
        quantized = [s.removesuffix(".weight") in held for s in sources]
        names.append(path)
        if not any(quantized):
            floats.append(path)
        elif not all(quantized):
            part = sources[quantized.index(False)]
            raise WeightsError(f"{loader.label}: {path} fuses quantized and float source layers ({part} is float)")
    return _compress(floats, names)


def prepare_loader(loader, model_class, config: PretrainedConfig) -> None:
    """Set the float layers' exclude_modules and the in_perm hook before planning."""
    excluded = float_layers(loader, model_class, config)
    config.quantization = config.quantization.model_copy(update={"exclude_modules": excluded or None})
    loader.prepend_hooks({f"*.{PERM_NAME}": same_permutation})


def check_plans(plans, loader, config: PretrainedConfig) -> None:
    """Before writing: fused layers share one act-order, row-parallel act-order stays per rank."""
    tp = config.mapping.tp_size
    for plan in plans:
        for t in plan.targets:
            if not t.key.endswith(f".{PERM_NAME}"):
                continue
            perms = [loader.source.load(s) for s in plan.sources[t.key]]
            try:
                same_permutation(t.key, perms, config)
            except ValueError as err:
                raise WeightsError(f"{loader.label}: {err}") from None
            if t.tp_dim == 0 and tp > 1:
                k = perms[0].shape[0] // tp
                part = perms[0][plan.tp_rank * k:(plan.tp_rank + 1) * k]
                if part.numel() and not ((part >= plan.tp_rank * k) & (part < (plan.tp_rank + 1) * k)).all():
                    raise BestiaryError(
                        f"--tp_size {tp}: {t.module_path} has act-order (desc_act) groups mixing the input "
                        f"features of different tensor-parallel ranks; convert this GPTQ checkpoint with --tp_size 1")

