"""`bestiary convert`: any supported source -> checkpoint dir (config.json + rank{N}.safetensors).

Everything that can be checked without reading weights (architecture, config, tp/pp
splits, key maps in both directions) is checked before the output directory is created.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bestiary.core.convert.loader import Target, WeightsLoader, model_targets
from bestiary.core.convert.memory import freed_memory_returned
from bestiary.core.convert.progress import progress
from bestiary.core.format.checkpoint import (
    StreamingSafetensorsWriter,
    atomic_directory,
    rank_file,
    write_json,
)
from bestiary.core.format.config import Mapping, PretrainedConfig, QuantConfig
from bestiary.core.format.errors import BestiaryError, ConfigError
from bestiary.core.format.output_dir import check_output_dir
from bestiary.core.sources import ModelSource, open_source
from bestiary.registry import Registry, default_registry, resolve
from bestiary.registry.capabilities import check_supported
from bestiary.registry.spec import ArchitectureSpec

DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass
class RankPlan:
    """What one rank's file will hold and where each tensor comes from."""

    rank: int
    targets: list[Target]
    sources: dict[str, list[str]]
    tp_rank: int
    reads: list[Target] | None = None  # what the loader fills (float weights of quantized linears)
    quantizers: dict | None = None  # weight key -> WeightOnlySlot that packs it
    later: list[Target] | None = None  # written as placeholders, calibrated after (KV cache scales)


def source_dtype(source: ModelSource) -> str:
    """The dtype the source was saved in (HF torch_dtype/dtype), float32 when unknown."""
    name = str(source.hf_config.get("torch_dtype") or source.hf_config.get("dtype") or "float32")
    return DTYPE_ALIASES.get(name.replace("torch.", ""), "float32")


def build_config(spec: ArchitectureSpec, source: ModelSource, dtype: str, mapping: Mapping) -> PretrainedConfig:
    """The checkpoint config of `source` for `spec` (ConfigError names the bad field)."""
    from_hf = resolve(spec.from_hf_config)
    return from_hf(source.hf_config, dtype, mapping, source=str(source.path))


def expert_mapping(tp_size: int, pp_size: int, moe_tp_size: int | None = None,
                   moe_ep_size: int | None = None) -> Mapping:
    """The Mapping of the convert flags; a bad --moe_tp_size / --moe_ep_size is a one-line error."""
    from bestiary.core.format.config import moe_split

    for flag, value in (("--moe_tp_size", moe_tp_size), ("--moe_ep_size", moe_ep_size)):
        if value is not None and value < 1:
            raise BestiaryError(f"{flag} {value}: expected a positive integer")
    try:
        moe_tp, moe_ep = moe_split(tp_size, moe_tp_size, moe_ep_size)
    except ValueError:
        given = " ".join(f"{f} {v}" for f, v in (("--moe_tp_size", moe_tp_size), ("--moe_ep_size", moe_ep_size))
                         if v is not None)
        raise BestiaryError(f"{given}: moe_tp_size * moe_ep_size must equal --tp_size {tp_size}") from None
    return Mapping(tp_size=tp_size, pp_size=pp_size, moe_tp_size=moe_tp, moe_ep_size=moe_ep)


def check_expert_parallel(spec: ArchitectureSpec, config: PretrainedConfig) -> None:
    """moe_ep_size > 1 needs an architecture with experts (Supports.expert_parallel) whose
    num_local_experts it divides; a one-line error naming --moe_ep_size otherwise."""
    ep = config.mapping.moe_ep_size
    if ep == 1:
        return
    check_supported(spec, moe_ep_size=ep)
    experts = getattr(config, "num_local_experts", None)
    if not experts or experts % ep:
        raise BestiaryError(f"--moe_ep_size {ep}: {spec.name}'s num_local_experts {experts} is not divisible by it")


def check_tokenizer(source: ModelSource) -> None:
    """The source's tokenizer must load and its chat template compile (a garbage tokenizer.json or a
    template syntax error is refused before any weight is read; a template's own runtime errors
    show only when it is used, with --chat)."""
    if source.tokenizer is None:
        return
    from bestiary.core.runtime.chat_template import compile_template
    from bestiary.core.runtime.tokenizer import Tokenizer

    where = source.path / "tokenizer.json" if source.path.is_dir() else source.path
    tokenizer = Tokenizer(source.tokenizer.tokenizer_json, source.tokenizer.tokenizer_config, str(where))
    if tokenizer.chat_template:
        try:
            compile_template(tokenizer.chat_template)
        except BestiaryError as err:
            raise BestiaryError(f"{where.with_name('tokenizer_config.json') if source.path.is_dir() else where}: "
                                f"{err}") from None


def instantiate(spec: ArchitectureSpec, config: PretrainedConfig, rank: int, device="meta") -> nn.Module:
    """The architecture's model for `rank`; an impossible split is a one-line error."""
    model_class = resolve(spec.model_class)
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


@freed_memory_returned()  # temporaries go back to the OS: resident memory stays near one rank file
def convert(
    model_dir: str | Path,
    output_dir: str | Path,
    dtype: str = "auto",
    tp_size: int = 1,
    pp_size: int = 1,
    architecture: str | None = None,
    customized_key_dict: dict | None = None,
    registry: Registry | None = None,
    show_progress: bool = True,
    quantization: QuantConfig | None = None,
    calib_text: str | Path | None = None,
    weight_quantizer: str | None = None,
    smoothquant_alpha: float | None = None,
    tune_steps: int | None = None,
    allow_nonfinite: bool = False,
    use_parallel_embedding: bool = False,
    embedding_sharding_dim: int = 0,
    moe_tp_size: int | None = None,
    moe_ep_size: int | None = None,
) -> Path:
    """Convert `model_dir` into a checkpoint at `output_dir`; returns the output path.

    `quantization` (see core.quant.options for the CLI flags) quantizes the linear weights
    and/or selects a quantized KV cache (scales calibrated on `calib_text`, or a built-in text);
    the section is written to config.json. `weight_quantizer`: "rtn" or "gptq" (default: gptq for
    int4 weights, calibrated on `calib_text` or the built-in texts; core.convert.quantize_calibrated).
    `tune_steps`: steps of end-to-end scale tuning after GPTQ (default core.convert.tune.DEFAULT_STEPS
    for GPTQ int4, 0 = none). `smoothquant_alpha`: W8A8_SQ_PER_CHANNEL's migration strength (default 0.5; core.quant.act_slot).
    A source tensor with NaN or inf values is refused unless `allow_nonfinite`. `output_dir` must
    be new, empty or an earlier checkpoint (core.format.output_dir), never the source.
    `moe_tp_size` / `moe_ep_size` (MoE architectures; moe_tp_size * moe_ep_size = tp_size, one given
    derives the other): each rank holds E / moe_ep_size whole experts, their FFN dim split over
    moe_tp_size ranks (expert parallelism, core.layers.moe)."""
    registry = registry or default_registry()
    check_output_dir(output_dir, "checkpoint", [model_dir])  # before any weight is read
    source = open_source(model_dir)
    spec = registry.for_hf_config(source.hf_config, str(source.path), architecture)
    if dtype != "auto" and dtype not in DTYPE_ALIASES:
        raise BestiaryError(f"--dtype {dtype!r}: expected auto, float32, float16 or bfloat16")
    dtype = source_dtype(source) if dtype == "auto" else DTYPE_ALIASES[dtype]
    for flag, value in (("--tp_size", tp_size), ("--pp_size", pp_size)):
        if value < 1:
            raise BestiaryError(f"{flag} {value}: expected a positive integer")
    config = build_config(spec, source, dtype, expert_mapping(tp_size, pp_size, moe_tp_size, moe_ep_size))
    check_expert_parallel(spec, config)
    if use_parallel_embedding:  # the embedding split over the tp ranks (core.layers.embedding)
        if embedding_sharding_dim not in (0, 1):
            raise BestiaryError(f"--embedding_sharding_dim {embedding_sharding_dim}: expected 0 (vocab) or 1 (hidden)")
        config.use_parallel_embedding, config.embedding_sharding_dim = True, embedding_sharding_dim
    check_tokenizer(source)
    from bestiary.core.convert import import_prequantized  # AWQ / GPTQ sources: imported, not quantized

    hf_quant = import_prequantized.read_hf_quant(source)
    if hf_quant is not None:
        quantization = import_prequantized.import_quant_config(hf_quant, quantization)
    if quantization is not None:
        config.quantization = quantization
    check_supported(spec, tp_size, pp_size, config.quantization.quant_algo, config.quantization.kv_cache_quant_algo)
    from bestiary.core.convert.quantize_calibrated import (
        check_tune_steps,
        check_weight_quantizer,
        needs_activation_stats,
    )

    method = check_weight_quantizer(quantization, weight_quantizer, prequantized=hf_quant is not None)
    tune_steps = check_tune_steps(quantization, method, tune_steps)
    calibrated = needs_activation_stats(quantization, method)  # tp / pp ranks: quantized once at tp 1, then cut
    if config.num_hidden_layers < pp_size:
        raise BestiaryError(f"--pp_size {pp_size}: the model has only {config.num_hidden_layers} layers")
    weights = source.weights if hf_quant is None else import_prequantized.prequantized_weights(source, hf_quant)
    loader = WeightsLoader(weights, spec, config, customized_key_dict, label=str(source.path),
                           source_model_type=source.hf_config.get("model_type"), allow_nonfinite=allow_nonfinite)
    if hf_quant is not None:
        import_prequantized.prepare_loader(loader, resolve(spec.model_class), config)
    plans = plan_ranks(loader, spec, config, prequantized=hf_quant is not None)
    if smoothquant_alpha is not None:  # W8A8_SQ_PER_CHANNEL's migration strength (default 0.5)
        from bestiary.core.quant.act_slot import set_smoothquant_alpha

        set_smoothquant_alpha([s for p in plans for s in (p.quantizers or {}).values()], smoothquant_alpha)
    if hf_quant is not None:
        import_prequantized.check_plans(plans, loader, config)
    with atomic_directory(Path(output_dir), "checkpoint", [model_dir]) as tmp, progress(show_progress) as bar:
        task = bar.add_task("convert", total=sum(len(p.reads or p.targets) for p in plans))
        whole = None  # calibrated on tp ranks: the tp 1 checkpoint they are cut from
        if calibrated and config.mapping.world_size > 1:  # quantize once on the whole model, then shard (core.convert.quantize_calibrated)
            from bestiary.core.convert.quantize_calibrated import write_sharded_rank

            bar.update(task, visible=False)
            bar.stop()  # the tp 1 convert shows its own bars
            whole = convert(model_dir, tmp / "calibrated_tp1", dtype, 1, 1, architecture, customized_key_dict,
                            registry, show_progress, quantization, calib_text, method, smoothquant_alpha,
                            tune_steps, allow_nonfinite, use_parallel_embedding, embedding_sharding_dim)
            bar.start()
            bar.update(task, total=sum(len(p.targets) for p in plans), visible=True)
            for plan in plans:
                write_sharded_rank(tmp, plan, whole, config, resolve(spec.model_class), bar, task)
        elif calibrated:
            from bestiary.core.convert.quantize_calibrated import (
                weight_calibration_ids,
                write_calibrated_rank,
            )

            ids = weight_calibration_ids(source.tokenizer, config.vocab_size, calib_text)
            write_calibrated_rank(tmp, plans[0], loader, config, resolve(spec.model_class), ids, method, bar, task,
                                  tune_steps)
        for plan in plans if not calibrated else ():
            write_rank(tmp, plan, loader, config, bar, task)
        if whole is not None:
            shutil.rmtree(whole)  # its KV scales, calibrated on the whole model, were cut with the rest
        elif config.quantization.kv_cache_quant_algo and config.mapping.world_size > 1:  # calibrated on the whole model
            from bestiary.core.convert.kv_scales import copy_kv_scales

            tp1 = convert(model_dir, tmp / "kv_calibration_tp1", dtype, 1, 1, architecture, customized_key_dict,
                          registry, False, quantization, calib_text, weight_quantizer, smoothquant_alpha,
                          tune_steps, allow_nonfinite, use_parallel_embedding, embedding_sharding_dim)
            copy_kv_scales(tp1, tmp, config)
            shutil.rmtree(tp1)
        elif config.quantization.kv_cache_quant_algo:
            from bestiary.core.convert.calibration import calibration_ids
            from bestiary.core.convert.kv_scales import calibrate_kv_scales

            ids = calibration_ids(source.tokenizer, config.vocab_size, calib_text,
                                  config.max_position_embeddings)
            calibrate_kv_scales(tmp, config, resolve(spec.model_class), ids)
        write_json(tmp / "config.json", config.to_json_dict())
        if source.tokenizer is not None:
            (tmp / "tokenizer.json").write_text(source.tokenizer.tokenizer_json)
            write_json(tmp / "tokenizer_config.json", source.tokenizer.tokenizer_config)
    return Path(output_dir)


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
                for name, part in stream_rows(loader, target, plan.sources[target.key], blocks, slot, scale_dtype).items():
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
