"""`bestiary convert --dry_run`: what a convert would do, and what looks wrong, without writing anything.

1. map: for every rank's target tensor, the source tensor(s) its key map gives, the postprocess
   hook and the part of each source the rank reads (the TP slice);
2. strict: target tensors whose source is missing, source tensors nothing uses;
3. shapes: rank 0's tensors are loaded and postprocessed (weights are read, nothing written)
   and compared with the model's shapes;
4. orientation: a square matrix converts and runs just as well transposed, so shapes cannot
   catch a forgotten (or extra) transpose. When the source is an HF directory whose class
   transformers has (and small enough, `REFERENCE_MAX_PARAMS`), both models run one short
   sequence; logits that differ are traced to the square tensors whose transpose brings them
   back within 1e-4 * max(1, max|ref|) (each tried alone, on a tp 1 copy of the model).
   Without such a reference the square tensors are listed as unchecked.
5. trace: a miss no transpose explains is placed at the first layer and sub-module that departs
   from the reference, and the usual config mistakes (rotary fraction, rope interleave, a boolean
   field of the family, a same-named config.json field read otherwise) are tried and named
   (core.convert.lint_trace).

`LintReport.problems()` lists everything flagged; `to_json()` is the `--report FILE.json` body.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bestiary.core.convert.calibration import chunk_logits
from bestiary.core.convert.lint_trace import (
    close,
    config_suspects,
    departing_part,
    first_departure,
    same_named_mismatches,
)
from bestiary.core.convert.loader import Target, WeightsLoader, model_targets
from bestiary.core.convert.options import expert_mapping
from bestiary.core.convert.source_to_checkpoint import (
    build_config,
    check_expert_parallel,
    instantiate,
    source_dtype,
)
from bestiary.core.format.config import Mapping, PretrainedConfig
from bestiary.core.format.errors import BestiaryError, WeightsError
from bestiary.core.format.hf_config import DecoderConfig
from bestiary.core.runtime.model import DecoderLM
from bestiary.core.sources import ModelSource, open_source
from bestiary.registry import Registry, default_registry
from bestiary.registry.capabilities import check_supported
from bestiary.registry.spec import ArchitectureSpec

REFERENCE_MAX_PARAMS = 2_000_000_000  # larger sources skip the reference forward (memory and time)
REFERENCE_TOKENS = 8


@dataclass
class TensorRow:
    """One target tensor of one rank and where it comes from."""

    rank: int
    target: str
    shape: tuple[int, ...]
    sources: list[str]
    postprocess: str
    tp_slice: str


@dataclass
class LintReport:
    """The dry run's findings (see the module doc)."""

    architecture: str
    source: str
    tp_size: int
    pp_size: int
    tensors: list[TensorRow] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "target: source" whose source tensor is absent
    unused: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)
    suspicious: list[str] = field(default_factory=list)  # "target: why"
    notes: list[str] = field(default_factory=list)  # what was (not) checked

    def problems(self) -> list[str]:
        """One line per finding; empty when the convert looks right."""
        return ([f"missing source tensor for {m}" for m in self.missing]
                + [f"unused source tensor {u}" for u in self.unused]
                + self.shape_errors + [f"suspicious {s}" for s in self.suspicious])

    def to_json(self) -> dict:
        """The report as JSON-ready data (--report)."""
        return asdict(self) | {"problems": self.problems()}


def hook_name(fn) -> str:
    """'module:function' of a postprocess hook."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def tp_slice(loader: WeightsLoader, target: Target, source_key: str, tp_size: int, tp_rank: int) -> str:
    """How rank `tp_rank` reads `source_key` for `target`: whole, replicated, or a dim's part."""
    hook = loader.hook_for(target.key)
    if tp_size == 1:
        return "whole"
    if getattr(hook, "slices_itself", False):
        return f"whole; the hook cuts rank {tp_rank}'s part"
    experts = f"expert group {target.experts[1] + 1} of {target.experts[0]}, " if target.experts else ""
    tp_size, tp_rank = target.tp_split or (tp_size, tp_rank)
    if target.tp_dim < 0 or tp_size == 1:
        return f"{experts}whole" if experts else "replicated"
    flip = getattr(hook, "transposes_source", False)
    dim = loader._slice_dim(target, source_key, tp_size, flip)
    return f"{experts}dim {dim}, part {tp_rank + 1} of {tp_size}"


def map_ranks(report: LintReport, loader: WeightsLoader, spec: ArchitectureSpec, config: PretrainedConfig) -> None:
    """Steps 1 and 2 for every rank: the rows, missing and unused source tensors."""
    for rank in range(config.mapping.world_size):
        model = instantiate(spec, config, rank)
        targets = model_targets(model)
        by_key, aliases = {t.key: t for t in targets}, model.source_aliases()
        for target in targets:
            sources = loader.sources_of(target, by_key, model.layer_offset, aliases)
            absent = [s for s in sources if s not in loader._source_keys]
            report.missing += [f"{target.key}: {s}" for s in absent]
            loader.used.update(s for s in sources if s not in absent)
            where = tp_slice(loader, target, sources[0], config.mapping.tp_size, model.tp_rank) if not absent else "-"
            report.tensors.append(TensorRow(rank, target.key, target.shape, sources,
                                            hook_name(loader.hook_for(target.key)), where))
    report.missing = list(dict.fromkeys(report.missing))
    report.unused = loader.unused_source_keys()


def check_shapes(report: LintReport, loader: WeightsLoader, spec: ArchitectureSpec, config: PretrainedConfig) -> None:
    """Step 3: load and postprocess rank 0's tensors; a shape or hook error is recorded, not raised."""
    model = instantiate(spec, config, 0)
    targets = model_targets(model)
    by_key, aliases = {t.key: t for t in targets}, model.source_aliases()
    for target in targets:
        sources = loader.sources_of(target, by_key, model.layer_offset, aliases)
        if any(s not in loader._source_keys for s in sources):
            continue
        try:
            loader.load(target, sources, config.mapping.tp_size, model.tp_rank)
        except WeightsError as err:
            report.shape_errors.append(str(err))


def load_tp1(loader: WeightsLoader, spec: ArchitectureSpec, config: PretrainedConfig) -> tuple[DecoderLM, dict]:
    """A float32 tp 1 copy of the model on the CPU, ready to run, and its state dict."""
    config = config.model_copy(update={"mapping": Mapping(), "dtype": "float32"})
    loader.config = config
    model = instantiate(spec, config, 0)
    targets = model_targets(model)
    by_key, aliases = {t.key: t for t in targets}, model.source_aliases()
    weights: dict[str, torch.Tensor] = {}
    for target in targets:
        weights |= loader.load(target, loader.sources_of(target, by_key, 0, aliases), 1, 0)
    return ready_model(spec, config, weights), weights


def ready_model(spec: ArchitectureSpec, config: PretrainedConfig, weights: dict) -> DecoderLM:
    """The model of `config` holding `weights`, prepared for inference on the CPU."""
    model = instantiate(spec, config, 0)
    model.load_state_dict(weights, strict=True, assign=True)
    model.eval()
    model.prepare_for_inference()
    return model


def hf_reference(source: ModelSource):
    """The source as a float32 transformers model, or (None, why not)."""
    if not source.path.is_dir() or not source.hf_config.get("architectures"):
        return None, "the source is not an HF directory with `architectures`"
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    name = source.hf_config["architectures"][0]
    cls = getattr(transformers, name, None)
    if cls is None:
        return None, f"transformers has no class {name}"
    params = sum(math.prod(source.weights.shape(k)) for k in source.weights.keys())
    if params > REFERENCE_MAX_PARAMS:
        return None, f"{params} parameters: too large for the reference forward"
    try:
        return cls.from_pretrained(source.path).float().eval(), ""
    except Exception as err:  # noqa: BLE001 - the reference is optional: say why it is missing
        return None, f"transformers could not load it ({type(err).__name__}: {str(err).splitlines()[0][:120]})"


def run_with_layers(spec: ArchitectureSpec, config: PretrainedConfig, weights: dict,
                    ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each decoder layer's output [T, H], logits [T, V]) of the model holding `weights`."""
    model = ready_model(spec, config, weights)
    outs: list[torch.Tensor] = []
    for layer in model.transformer.layers:
        layer.register_forward_hook(lambda _m, _i, out: outs.append(out.float()))
    return outs, chunk_logits(model, ids).float()


def check_orientation(report: LintReport, loader: WeightsLoader, spec: ArchitectureSpec, config: PretrainedConfig,
                      source: ModelSource) -> None:
    """Step 4: run the converted tp 1 model against the HF reference; a miss is traced layer by layer
    (our layer i's output vs the reference's hidden state i + 1) to the square tensors whose
    transpose makes that layer match again."""
    tp1 = config.model_copy(update={"mapping": Mapping()})
    square = [t.key for t in model_targets(instantiate(spec, tp1, 0)) if len(t.shape) == 2 and t.shape[0] == t.shape[1]]
    hf, why = hf_reference(source)
    if hf is None:
        if square:
            report.notes.append(f"orientation of {len(square)} square tensors unchecked: {why}")
        return
    ids = [(7 * i + 3) % config.vocab_size for i in range(REFERENCE_TOKENS)]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        ref, hidden = out.logits[0].float(), [h[0].float() for h in out.hidden_states]  # [T, V], L + 1 x [T, H]
        model, weights = load_tp1(loader, spec, config)
        config = model.config
        layers, logits = run_with_layers(spec, config, weights, ids)
        diff = (logits - ref).abs().max().item()
        report.notes.append(f"reference forward ({type(hf).__name__}, {len(ids)} tokens): max|logits - reference| "
                            f"{diff:.3e} (bound {1e-4 * max(1.0, ref.abs().max().item()):.3e})")
        if close(logits, ref):
            return
        for i in range(len(layers)):
            at_end = i == len(layers) - 1  # the reference's last hidden state may be normed: compare logits
            if (close(logits, ref) if at_end else close(layers[i], hidden[i + 1])):
                continue
            prefix = f"transformer.layers.{i}."
            candidates = [k for k in square if k.startswith(prefix) or (at_end and not k.startswith("transformer.layers."))]
            for key in candidates:
                flipped = weights | {key: weights[key].t().contiguous()}
                trial_layers, trial_logits = run_with_layers(spec, config, flipped, ids)
                if close(trial_logits, ref) if at_end else close(trial_layers[i], hidden[i + 1]):
                    report.suspicious.append(f"{key}: transposed? with it transposed, "
                                             f"{'the logits match' if at_end else f'layer {i} output matches'} the reference")
                    weights, layers, logits = flipped, trial_layers, trial_logits
                    break
            else:
                break
    if not close(logits, ref):
        trace_departure(report, spec, config, weights, ids, hf, (layers, logits), (hidden, ref), source.hf_config)


def trace_departure(report: LintReport, spec: ArchitectureSpec, config: PretrainedConfig, weights: dict,
                    ids: list[int], hf, ours: tuple[list, torch.Tensor], theirs: tuple[list, torch.Tensor],
                    hf_config: dict) -> None:
    """Step 5 (core.convert.lint_trace): a miss no transpose explains is placed at its first layer and
    sub-module, and the config fields whose usual mistakes would explain it are tried one at a time."""
    (layers, logits), (hidden, ref) = ours, theirs
    base = set(DecoderConfig.model_fields) - {"position_embedding_type", "rotary_pct"}
    report.suspicious += [f"config {line}" for line in same_named_mismatches(config, hf_config, base)]
    i = first_departure(layers, hidden)
    where = "the logits" if i is None else f"layer {i}"
    if i is not None:
        model = ready_model(spec, config, weights)
        part = departing_part(model, hf, i, lambda: chunk_logits(model, ids), lambda: hf(torch.tensor([ids])))
        where += f" ({part})" if part else ""
    matches = lambda trial_layers, trial_logits: (close(trial_logits, ref) if i is None  # noqa: E731
                                                  else close(trial_layers[i], hidden[i + 1]))
    for name, value in config_suspects(config, base):
        try:
            trial = config.model_copy(update={name: value})
            trial_layers, trial_logits = run_with_layers(spec, trial, weights, ids)
        except Exception:  # noqa: BLE001, S112 - a trial that cannot even build is not the explanation
            continue
        if matches(trial_layers, trial_logits):
            verb = "match" if i is None else "matches"
            report.suspicious.append(f"config {name}: {getattr(config, name)!r}? with {value!r}, {where} {verb} "
                                     f"the {type(hf).__name__} reference")
            return
    diff = (logits - ref).abs().max().item()
    report.suspicious.append(f"logits: differ from the {type(hf).__name__} reference by {diff:.3e}, first at {where} "
                             "(not explained by transposed square tensors or the usual config mistakes)")


def lint(model_dir: str | Path, tp_size: int = 1, pp_size: int = 1, architecture: str | None = None,
         registry: Registry | None = None, customized_key_dict: dict | None = None,
         reference: bool = True, moe_tp_size: int | None = None, moe_ep_size: int | None = None) -> LintReport:
    """The dry run of `convert(model_dir, ..., tp_size, pp_size, architecture)`: nothing is written.

    Configuration errors (unknown architecture, bad config field, unsupported option) raise as
    convert would; everything about the tensors is collected in the report."""
    registry = registry or default_registry()
    source = open_source(model_dir)
    spec = registry.for_hf_config(source.hf_config, str(source.path), architecture)
    check_supported(spec, tp_size, pp_size)
    if min(tp_size, pp_size) < 1:
        raise BestiaryError(f"--tp_size {tp_size} --pp_size {pp_size}: expected positive integers")
    mapping = expert_mapping(tp_size, pp_size, moe_tp_size, moe_ep_size)
    config = build_config(spec, source, source_dtype(source), mapping)
    check_expert_parallel(spec, config)
    if config.num_hidden_layers < pp_size:
        raise BestiaryError(f"--pp_size {pp_size}: the model has only {config.num_hidden_layers} layers")
    loader = WeightsLoader(source.weights, spec, config, customized_key_dict, label=str(source.path),
                           source_model_type=source.hf_config.get("model_type"), allow_nonfinite=True)
    report = LintReport(spec.name, str(source.path), tp_size, pp_size)
    map_ranks(report, loader, spec, config)
    check_shapes(report, loader, spec, config)
    if reference and not (report.missing or report.shape_errors):
        check_orientation(report, loader, spec, config, source)
    return report
