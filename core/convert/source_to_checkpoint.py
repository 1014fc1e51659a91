"""`bestiary convert`: any supported source -> checkpoint dir (config.json + rank{N}.safetensors).

`convert(model_dir, output_dir, options)` runs in three steps. Plan (`plan_convert`): everything that
can be checked without reading weights (architecture, config, tp/pp splits, quantization, key maps in
both directions) is checked before the output directory is created; the flags themselves already were,
when the `ConvertOptions` (core.convert.options) were made. Quantize + write (`write_weights`): every
rank file, streamed and rounded to nearest, or quantized from the float model's statistics; calibrated
tp / pp ranks are cut from a tp 1 conversion of the same options (`ConvertOptions.tp1`). Then the KV
cache scales, config.json and the tokenizer files (`write_kv_scales`, `write_config_and_tokenizer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress, TaskID

from bestiary.core.convert.loader import Target, WeightsLoader, model_targets
from bestiary.core.convert.memory import freed_memory_returned
from bestiary.core.convert.options import DTYPE_ALIASES, ConvertOptions
from bestiary.core.convert.progress import progress
from bestiary.core.format.checkpoint import (
    StreamingSafetensorsWriter,
    atomic_directory,
    rank_file,
    write_json,
)
from bestiary.core.format.config import Mapping, PretrainedConfig
from bestiary.core.format.errors import BestiaryError, ConfigError
from bestiary.core.format.output_dir import check_output_dir
from bestiary.core.runtime.model import DecoderLM
from bestiary.core.sources import ModelSource, open_source
from bestiary.registry import Registry, default_registry, resolve
from bestiary.registry.capabilities import check_supported
from bestiary.registry.spec import ArchitectureSpec


@dataclass
class RankPlan:
    """What one rank's file will hold and where each tensor comes from."""

    rank: int
    targets: list[Target]
    sources: dict[str, list[str]]
    tp_rank: int
    reads: list[Target] | None = None  # what the loader fills (float weights of quantized linears)
    quantizers: dict | None = None  # weight key -> the slot that packs it (quantize.PackingSlot)
    later: list[Target] | None = None  # written as placeholders, calibrated after (KV cache scales)


def source_dtype(source: ModelSource) -> str:
    """The dtype the source was saved in (HF torch_dtype/dtype), float32 when unknown."""
    name = str(source.hf_config.get("torch_dtype") or source.hf_config.get("dtype") or "float32")
    return DTYPE_ALIASES.get(name.replace("torch.", ""), "float32")


def build_config(spec: ArchitectureSpec, source: ModelSource, dtype: str, mapping: Mapping) -> PretrainedConfig:
    """The checkpoint config of `source` for `spec` (ConfigError names the bad field)."""
    from_hf = resolve(spec.from_hf_config)
    return from_hf(source.hf_config, dtype, mapping, source=str(source.path))


def check_expert_parallel(spec: ArchitectureSpec, config: PretrainedConfig) -> None:
    """moe_ep_size > 1 needs an architecture with experts (Supports.expert_parallel) whose
    num_local_experts it divides; a one-line error naming --moe_ep_size otherwise."""
    ep = config.mapping.moe_ep_size
    assert ep is not None, "set by Mapping's validation"
    if ep == 1:
        return
    check_supported(spec, moe_ep_size=ep)
    experts = getattr(config, "num_local_experts", None)
    if not experts or experts % ep:
        raise BestiaryError(f"--moe_ep_size {ep}: {spec.name}'s num_local_experts {experts} is not divisible by it")


def check_tokenizer(source: ModelSource, vocab_size: int) -> None:
    """The source's tokenizer must load, its special and added token ids lie in the model's vocabulary
    (run refuses the engine otherwise) and its chat template compile (a garbage tokenizer.json or a
    template syntax error is refused before any weight is read; a template's own runtime errors
    show only when it is used, with --chat)."""
    if source.tokenizer is None:
        return
    from bestiary.core.runtime.chat_template import compile_template
    from bestiary.core.runtime.tokenizer import Tokenizer

    where = source.path / "tokenizer.json" if source.path.is_dir() else source.path
    tokenizer = Tokenizer(source.tokenizer.tokenizer_json, source.tokenizer.tokenizer_config, str(where))
    tokenizer.check_vocab(vocab_size, str(source.path / "config.json" if source.path.is_dir() else source.path))
    if tokenizer.chat_template:
        try:
            compile_template(tokenizer.chat_template)
        except BestiaryError as err:
            raise BestiaryError(f"{where.with_name('tokenizer_config.json') if source.path.is_dir() else where}: "
                                f"{err}") from None


def instantiate(spec: ArchitectureSpec, config: PretrainedConfig, rank: int, device: str = "meta") -> DecoderLM:
    """The architecture's model for `rank`; an impossible split is a one-line error."""
    model_class: type[DecoderLM] = resolve(spec.model_class)
    try:
        return model_class(config, rank, device=device)
    except ValueError as err:
        m = config.mapping
        raise BestiaryError(f"--tp_size {m.tp_size} --pp_size {m.pp_size}: {err}") from None
    except TypeError as err:  # a field the model needs is missing (None) or of the wrong kind
        raise ConfigError(f"{spec.name}: the model cannot be built from this config ({err})") from None


def plan_ranks(
    loader: WeightsLoader, spec: ArchitectureSpec, config: PretrainedConfig, prequantized: bool = False
) -> list[RankPlan]:
    """Targets and source keys of every rank; fails on a missing or unused source tensor."""
    from bestiary.core.convert.quantize import loader_targets

    plans = []
    for rank in range(config.mapping.world_size):
        model = instantiate(spec, config, rank)
        targets = model_targets(model)
        reads, quantizers, later = loader_targets(model, targets, prequantized)  # float linears: pack later
        sources = loader.plan(reads, model.layer_offset, model.source_aliases())
        plans.append(RankPlan(rank, targets, sources, model.tp_rank, reads, quantizers, later))
    loader.check_all_used(sorted({t.key for p in plans for t in p.reads or p.targets}))
    return plans


@dataclass
class ConvertPlan:
    """A conversion checked and planned before the output directory is made: the source, its architecture,
    the checkpoint config, every rank's tensors, and how the linear weights are quantized."""

    source: ModelSource
    spec: ArchitectureSpec
    config: PretrainedConfig
    loader: WeightsLoader
    ranks: list[RankPlan]
    options: ConvertOptions  # as given, the dtype resolved and an AWQ / GPTQ source's quantization imported
    method: str  # the weight quantizer (quantize_calibrated.check_weight_quantizer)
    tune_steps: int  # end-to-end scale tuning steps (quantize_calibrated.check_tune_steps)
    calibrated: bool  # linears quantized from their inputs' statistics (core.convert.quantize_calibrated)

    @property
    def model_class(self) -> type[DecoderLM]:
        """The architecture's model class."""
        model_class: type[DecoderLM] = resolve(self.spec.model_class)
        return model_class


@freed_memory_returned()  # temporaries go back to the OS: resident memory stays near one rank file
def convert(
    model_dir: str | Path,
    output_dir: str | Path,
    options: ConvertOptions | None = None,
    *,
    registry: Registry | None = None,
    show_progress: bool = True,
) -> Path:
    """Convert `model_dir` into a checkpoint at `output_dir` as `options` say (ConvertOptions: dtype,
    tp / pp / MoE splits, quantization, calibration; the defaults when None); returns the output path.

    Plan (everything checked before any weight is read: plan_convert), then quantize and write the
    rank files (write_weights; calibrated quantization runs the float model over `options.calib_text`
    or the built-in texts), then the KV cache scales, config.json and the tokenizer. `output_dir` must
    be new, empty or an earlier checkpoint (core.format.output_dir), never the source. `registry`: the
    architectures (default_registry() when None); `show_progress`: rich progress bars on stderr."""
    options = options if options is not None else ConvertOptions()
    registry = registry or default_registry()
    check_output_dir(output_dir, "checkpoint", [model_dir])  # before any weight is read
    plan = plan_convert(model_dir, options, registry)
    with atomic_directory(Path(output_dir), "checkpoint", [model_dir]) as tmp, progress(show_progress) as bar:
        scales_cut = write_weights(tmp, model_dir, plan, registry, bar, show_progress)
        if not scales_cut:
            write_kv_scales(tmp, model_dir, plan, registry)
        write_config_and_tokenizer(tmp, plan)
    return Path(output_dir)


# --- plan: everything checked before the output directory is made ----------------------------------------
def plan_convert(model_dir: str | Path, options: ConvertOptions, registry: Registry) -> ConvertPlan:
    """Open the source and check and plan the conversion: architecture, config, splits, tokenizer,
    quantization (an AWQ / GPTQ source's imported), key maps both ways; one-line errors, no weight read."""
    from bestiary.core.convert import import_prequantized  # AWQ / GPTQ sources: imported, not quantized

    source = open_source(model_dir)
    spec = registry.for_hf_config(source.hf_config, str(source.path), options.architecture)
    dtype = source_dtype(source) if options.dtype == "auto" else DTYPE_ALIASES[options.dtype]
    options = options.model_copy(update={"dtype": dtype})
    config = plan_config(spec, source, options)
    check_tokenizer(source, config.vocab_size)
    hf_quant = import_prequantized.read_hf_quant(source)
    if hf_quant is not None:
        options = options.model_copy(
            update={"quantization": import_prequantized.import_quant_config(hf_quant, options.quantization)})
    if options.quantization is not None:
        config.quantization = options.quantization
    check_supported(spec, options.tp_size, options.pp_size, config.quantization.quant_algo,
                    config.quantization.kv_cache_quant_algo)
    method, tune_steps, calibrated = plan_quantizer(options, prequantized=hf_quant is not None)
    if config.num_hidden_layers < options.pp_size:
        raise BestiaryError(f"--pp_size {options.pp_size}: the model has only {config.num_hidden_layers} layers")
    weights = source.weights if hf_quant is None else import_prequantized.prequantized_weights(source, hf_quant)
    loader = WeightsLoader(weights, spec, config, options.customized_key_dict, label=str(source.path),
                           source_model_type=source.hf_config.get("model_type"),
                           allow_nonfinite=options.allow_nonfinite)
    if hf_quant is not None:
        import_prequantized.prepare_loader(loader, resolve(spec.model_class), config)
    ranks = plan_ranks(loader, spec, config, prequantized=hf_quant is not None)
    if options.smoothquant_alpha is not None:  # W8A8_SQ_PER_CHANNEL's migration strength (default 0.5)
        from bestiary.core.quant.act_slot import set_smoothquant_alpha

        set_smoothquant_alpha([s for p in ranks for s in (p.quantizers or {}).values()], options.smoothquant_alpha)
    if hf_quant is not None:
        import_prequantized.check_plans(ranks, loader, config)
    return ConvertPlan(source, spec, config, loader, ranks, options, method, tune_steps, calibrated)


def plan_config(spec: ArchitectureSpec, source: ModelSource, options: ConvertOptions) -> PretrainedConfig:
    """The checkpoint config of `source` in `options.dtype` (resolved), split as `options` say (experts
    over the ranks, the embedding over the tp ranks)."""
    config = build_config(spec, source, options.dtype, options.mapping())
    check_expert_parallel(spec, config)
    if options.use_parallel_embedding:  # the embedding split over the tp ranks (core.layers.embedding)
        config.use_parallel_embedding, config.embedding_sharding_dim = True, options.embedding_sharding_dim
    return config


def plan_quantizer(options: ConvertOptions, prequantized: bool) -> tuple[str, int, bool]:
    """(weight quantizer, tune steps, calibrated) for `options.quantization` (quantize_calibrated's checks:
    a quantizer or tune steps that do not apply are one-line ConfigErrors). Calibrated tp / pp ranks are
    quantized once at tp 1, then cut."""
    from bestiary.core.convert.quantize_calibrated import (
        check_tune_steps,
        check_weight_quantizer,
        needs_activation_stats,
    )

    method = check_weight_quantizer(options.quantization, options.weight_quantizer, prequantized=prequantized)
    tune_steps = check_tune_steps(options.quantization, method, options.tune_steps)
    return method, tune_steps, needs_activation_stats(options.quantization, method)


# --- quantize + write: the rank files, the KV cache scales, config.json and the tokenizer ------------------
def write_weights(tmp: Path, model_dir: str | Path, plan: ConvertPlan, registry: Registry, bar: Progress,
                  show_progress: bool) -> bool:
    """Quantize and write every rank file of `plan` into `tmp`: streamed and rounded to nearest, or
    quantized from the float model's statistics (one rank), or cut from a calibrated tp 1 conversion
    (tp / pp ranks). True when the KV cache scales were cut with the rest (nothing left to calibrate)."""
    task = bar.add_task("convert", total=sum(len(p.reads or p.targets) for p in plan.ranks))
    if plan.calibrated and plan.config.mapping.world_size > 1:
        write_cut_from_whole(tmp, model_dir, plan, registry, bar, task, show_progress)
        return True
    if plan.calibrated:
        from bestiary.core.convert.quantize_calibrated import weight_calibration_ids, write_calibrated_rank

        ids = weight_calibration_ids(plan.source.tokenizer, plan.config.vocab_size, plan.options.calib_text)
        write_calibrated_rank(tmp, plan.ranks[0], plan.loader, plan.config, plan.model_class, ids, plan.method,
                              bar, task, plan.tune_steps)
        return False
    for rank in plan.ranks:
        write_rank(tmp, rank, plan.loader, plan.config, bar, task)
    return False


def write_cut_from_whole(tmp: Path, model_dir: str | Path, plan: ConvertPlan, registry: Registry, bar: Progress,
                         task: TaskID, show_progress: bool) -> None:
    """Calibrated tp / pp ranks: the model quantized once, whole, by a tp 1 conversion into `tmp`, whose
    tensors (KV scales included) every rank then takes its part of (core.convert.quantize_calibrated)."""
    from bestiary.core.convert.quantize_calibrated import write_sharded_rank

    bar.update(task, visible=False)
    bar.stop()  # the tp 1 convert shows its own bars
    whole = convert(model_dir, tmp / "calibrated_tp1", plan.options.tp1(weight_quantizer=plan.method,
                                                                        tune_steps=plan.tune_steps),
                    registry=registry, show_progress=show_progress)
    bar.start()
    bar.update(task, total=sum(len(p.targets) for p in plan.ranks), visible=True)
    for rank in plan.ranks:
        write_sharded_rank(tmp, rank, whole, plan.config, plan.model_class, bar, task)
    shutil.rmtree(whole)  # its KV scales, calibrated on the whole model, were cut with the rest


def write_kv_scales(tmp: Path, model_dir: str | Path, plan: ConvertPlan, registry: Registry) -> None:
    """A quantized KV cache's scales, calibrated on the whole model: measured here (one rank), or by a
    tp 1 conversion whose scales are copied into every rank file. Nothing for a float KV cache."""
    config = plan.config
    if not config.quantization.kv_cache_quant_algo:
        return
    if config.mapping.world_size > 1:
        from bestiary.core.convert.kv_scales import copy_kv_scales

        tp1 = convert(model_dir, tmp / "kv_calibration_tp1", plan.options.tp1(tune_steps=plan.tune_steps),
                      registry=registry, show_progress=False)
        copy_kv_scales(tp1, tmp, config)
        shutil.rmtree(tp1)
        return
    from bestiary.core.convert.calibration import calibration_ids
    from bestiary.core.convert.kv_scales import calibrate_kv_scales

    ids = calibration_ids(plan.source.tokenizer, config.vocab_size, plan.options.calib_text,
                          config.max_position_embeddings)
    calibrate_kv_scales(tmp, config, plan.model_class, ids)


def write_config_and_tokenizer(tmp: Path, plan: ConvertPlan) -> None:
    """config.json, and the source's tokenizer.json / tokenizer_config.json when it has a tokenizer."""
    write_json(tmp / "config.json", plan.config.to_json_dict())
    if plan.source.tokenizer is not None:
        (tmp / "tokenizer.json").write_text(plan.source.tokenizer.tokenizer_json)
        write_json(tmp / "tokenizer_config.json", plan.source.tokenizer.tokenizer_config)


def write_rank(tmp: Path, plan: RankPlan, loader: WeightsLoader, config: PretrainedConfig, bar, task) -> None:
    """Stream rank `plan.rank`'s tensors into rank{N}.safetensors."""
    from bestiary.core.convert.quantize import needs_row_amax, quantize_loaded
    from bestiary.core.runtime.model import torch_dtype

    scale_dtype: torch.dtype = torch_dtype(config.dtype)
    tp = config.mapping.tp_size
    with rank_writer(tmp, plan) as writer:
        for target in plan.reads or plan.targets:
            slot = (plan.quantizers or {}).get(target.key)
            blocks = loader.row_blocks(target, plan.sources[target.key], tp)
            if blocks > 1 and (slot is None or slot.streams_rows()):
                rows = stream_rows(loader, target, plan.sources[target.key], blocks, slot, scale_dtype)
                for name, part in rows.items():
                    writer.write(name, part)
                bar.advance(task)
                continue
            for key, tensor in loader.load(target, plan.sources[target.key], tp, plan.tp_rank).items():
                slot = (plan.quantizers or {}).get(key)
                amax = None
                if slot is not None and needs_row_amax(target, slot, tp):  # the whole rows' max |w| [N]
                    whole = dataclasses.replace(target, shape=(target.shape[0], target.shape[1] * tp))
                    amax = loader.load(whole, plan.sources[target.key], 1, 0)[key].abs().amax(dim=1)
                packed = {key: tensor} if slot is None else quantize_loaded(key, tensor, slot, scale_dtype,
                                                                            row_amax=amax)
                for name, part in packed.items():
                    writer.write(name, part)
            bar.advance(task)


def stream_rows(loader: WeightsLoader, target, sources: list[str], blocks: int, slot,
                scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`target`'s checkpoint tensor(s) made `blocks` rows at a time (WeightsLoader.row_blocks): the float
    rows copied into the target tensor, or rounded by `slot` (quantize_rows) and their packed rows
    concatenated. Equal to the whole-tensor path bit for bit; holds one float block instead of the
    whole float32 tensor (SmolLM2's 49152 x 576 embedding: 113 MiB)."""
    from bestiary.core.convert.quantize import checkpoint_names

    if slot is None:
        out = torch.empty(target.shape, dtype=target.dtype)
        rows = target.shape[0] // blocks
        for i in range(blocks):
            out[i * rows:(i + 1) * rows] = loader.load_rows(target, sources, blocks, i)
        return {target.key: out}
    parts = [checkpoint_names(target.key, slot.quantize_rows(loader.load_rows(target, sources, blocks, i), scale_dtype))
             for i in range(blocks)]
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


@contextlib.contextmanager
def rank_writer(tmp: Path, plan: RankPlan):
    """The streaming writer of rank{N}.safetensors for `plan`: yields it, then writes the tensors made
    later (placeholders, calibrated after: KV cache scales) and closes; removes the file on error."""
    layout = [(t.key, t.dtype, t.shape) for t in plan.targets]
    writer = StreamingSafetensorsWriter(rank_file(tmp, plan.rank), layout, {"format": "pt"})
    try:
        yield writer
        for target in plan.later or ():
            writer.write(target.key, torch.ones(target.shape, dtype=target.dtype))  # calibrated after
    except BaseException:
        writer.abort()
        raise
    writer.close()
