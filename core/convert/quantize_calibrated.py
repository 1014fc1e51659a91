"""Calibrated convert: quantize each linear with the statistics of its own inputs.

Round to nearest (RTN) packs each weight as it streams by. A data-aware quantizer (GPTQ for
int4; the activation-quantized modes' SmoothQuant / AWQ scales and FP8 ranges) needs to know
what the layer's inputs look like, so the rank is written in four steps instead:

1. load: every tensor of the rank is read (quantized linears' weights as float32), and the
   rank's model is built from them in memory with float linears (the quantized model class,
   its quantized Linears turned back into float ones, so a tied lm_head is a Linear too);
2. calibrate: the float model runs over the calibration tokens (`calibration_ids(...,
   limit=WEIGHT_CALIB_TOKENS)`: `--calib_text FILE`, else the built-in texts) and
   core.quant.input_stats collects each quantized linear's input statistics;
3. (weight-only int4 with GPTQ) AWQ scales are searched and folded into the norms and linears
   that feed the quantized linears (core.quant.awq_fold), and their statistics rescaled;
4. (weight-only int4 with GPTQ, `tune_steps` > 0) every linear is quantized by GPTQ, then its
   group scales are tuned end to end towards the float model's next-token distributions over
   the calibration tokens, recorded in step 2 (core.convert.tune);
5. quantize + write: each weight is packed by its slot with its layer's statistics
   (`slot.quantize(w, scale_dtype, stats)`), or from its tuned codes, everything else is written
   as read.

Calibration runs the whole model in one process. A tensor- or pipeline-parallel checkpoint is made
the way TensorRT-LLM's quantize-then-shard flow makes it: the tp 1 checkpoint is converted first (these
steps, and its KV scales, on the whole model), then `write_sharded_rank` cuts every one of its
tensors into the ranks with the float weights' split rules (core.convert.quantize.rank_part):

    column-parallel   weight rows and the per-row scales / zero points / bias with them;
                      attention.qkv as [Q_r; K_r; V_r], whole kv heads replicated when KVH < tp
    row-parallel      the weight's input columns, group-wise scales / zero points along their
                      groups (in_features / tp must be a multiple of the group size: refused in
                      one line when the tp model is built), SmoothQuant / AWQ prequant scales [K]
                      along the inputs they scale; per-row int8 scales replicated
    per tensor        activation scales, FP8 weight scales, KV cache scales: replicated

so the ranks re-assemble bit for bit to the tp 1 tensors (statistics and scales come from the
whole rows and the whole input, never from one rank's part). A pipeline stage takes its layers'
tensors, renamed to its local layer indices (`transformer.layers.{i - layer_offset}`). Memory: the rank's float weights (float32 for the quantized
linears) and, for GPTQ, one [K, K] float32 Hessian per quantized linear; the tp 1 checkpoint is
read back one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bestiary.core.convert.calibration import calibrate_linears, calibration_chunks
from bestiary.core.convert.options import WEIGHT_QUANTIZERS
from bestiary.core.format.config import PretrainedConfig, QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.format.packing import Int4Codes, int4_roundtrip
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.apply import quantized_linears
from bestiary.core.quant.input_stats import LinearInputStats
from bestiary.core.quant.modes import ACT_ALGOS, linear_quant_of
from bestiary.core.runtime.model import DecoderLM

# GPTQ's Hessians and the scale tuning want many more tokens than the KV scales' 512: the whole
# built-in text (about 19,100 SmolLM2 tokens; more text kept lowering the int4 perplexity)
WEIGHT_CALIB_TOKENS = 24576
RANDOM_CALIB_TOKENS = 1024  # no text to read (a source without a tokenizer): seeded random ids


def default_weight_quantizer(quant: QuantConfig | None) -> str:
    """gptq for int4 weight-only, at any tp and pp (RTN int4 loses too much: docs/quantization.md),
    rtn otherwise (int8)."""
    lq = linear_quant_of(quant) if quant is not None else None
    return "gptq" if lq is not None and lq.bits == 4 and lq.algo not in ACT_ALGOS else "rtn"


def check_weight_quantizer(quant: QuantConfig | None, method: str | None, prequantized: bool = False) -> str:
    """The weight quantizer to use (`method`, or the default); ConfigError
    for one that does not apply. `prequantized`: the source holds packed AWQ/GPTQ weights
    (core.convert.import_prequantized), read as they are."""
    if method is not None and method not in WEIGHT_QUANTIZERS:
        raise ConfigError(f"--weight_quantizer {method!r}: expected one of {', '.join(WEIGHT_QUANTIZERS)}")
    if prequantized:
        if method is not None:
            raise ConfigError(f"--weight_quantizer {method}: the source is already quantized (AWQ/GPTQ); "
                              "its packed weights are imported as they are")
        return "rtn"  # nothing is quantized at convert
    if method is None:
        return default_weight_quantizer(quant)
    lq = linear_quant_of(quant) if quant is not None else None
    if lq is None:
        raise ConfigError(f"--weight_quantizer {method}: needs a weight quantization mode (--use_weight_only)")
    if method == "gptq" and lq.bits != 4:
        raise ConfigError("--weight_quantizer gptq: only for int4 weights (int8 is rounded to nearest)")
    if method == "gptq" and lq.algo in ACT_ALGOS:
        raise ConfigError(f"--weight_quantizer gptq: not with {lq.algo} (AWQ-scaled, rounded to nearest)")
    return method


def needs_activation_stats(quant: QuantConfig | None, method: str) -> bool:
    """True if converting to `quant` with weight quantizer `method` needs a calibration pass."""
    lq = linear_quant_of(quant) if quant is not None else None
    if lq is not None and lq.algo in ACT_ALGOS:  # activation scales (and SmoothQuant / AWQ scales)
        return True
    return is_gptq_int4(quant, method)


def needs_hessian(quant: QuantConfig | None, method: str) -> bool:
    """True if the statistics must include each layer's Hessian sum_t x_t x_t^T (GPTQ, AWQ search)."""
    lq = linear_quant_of(quant) if quant is not None else None
    if lq is not None and lq.algo in ACT_ALGOS:
        return lq.algo == "W4A8_AWQ"  # FP8 / SmoothQuant need the ranges only
    return needs_activation_stats(quant, method)


def is_gptq_int4(quant: QuantConfig | None, method: str) -> bool:
    """True for weight-only int4 quantized with GPTQ: the convert that folds AWQ scales into the layers
    (core.quant.awq_fold) and tunes the group scales end to end (core.convert.tune)."""
    lq = linear_quant_of(quant) if quant is not None else None
    return lq is not None and lq.bits == 4 and lq.algo not in ACT_ALGOS and method == "gptq"


def check_tune_steps(quant: QuantConfig | None, method: str, steps: int | None) -> int:
    """Steps of end-to-end scale tuning: `steps`, or by default tune.DEFAULT_STEPS for GPTQ int4 and 0
    otherwise; ConfigError for a negative count or steps asked where there are no GPTQ codes to tune."""
    from bestiary.core.convert.tune import DEFAULT_STEPS

    applies = is_gptq_int4(quant, method)
    if steps is None:
        return DEFAULT_STEPS if applies else 0
    if steps < 0:
        raise ConfigError(f"--tune_steps {steps}: expected 0 (no tuning) or a positive number of steps")
    if steps and not applies:
        raise ConfigError(f"--tune_steps {steps}: tunes int4 GPTQ weights only "
                          "(--use_weight_only --weight_only_precision int4, --weight_quantizer gptq)")
    return steps


def weight_calibration_ids(files, vocab_size: int, text_file) -> list[int]:
    """Calibration tokens for the weights: `text_file`, else the built-in texts (core.quant.calib_text),
    at most WEIGHT_CALIB_TOKENS; else (no tokenizer) RANDOM_CALIB_TOKENS seeded random ids."""
    from bestiary.core.convert.calibration import calibration_ids
    from bestiary.core.quant.calib_text import WEIGHT_CALIB_TEXT

    limit = WEIGHT_CALIB_TOKENS if files is not None or text_file is not None else RANDOM_CALIB_TOKENS
    return calibration_ids(files, vocab_size, text_file, None, limit=limit, builtin=WEIGHT_CALIB_TEXT)


def unquantize_linears(model: DecoderLM, shapes: dict[str, tuple[int, ...]]) -> dict[str, Linear]:
    """Turn every quantized Linear of `model` (meta) back into a float one; returns weight key -> Linear.

    `shapes`: weight key -> float weight shape [N, K]. The weight gets the model's dtype;
    packed tensors, scales and the slot are dropped."""
    out = {}
    for path, linear in quantized_linears(model).items():
        key = f"{path}.weight"
        for name, _ in list(linear.named_parameters(recurse=False)):
            if name != "bias":
                delattr(linear, name)
        linear.weight = nn.Parameter(torch.empty(shapes[key], dtype=model.dtype, device="meta"), requires_grad=False)
        linear.quant = None
        out[key] = linear
    return out


def load_tensors(model: DecoderLM, tensors: dict[str, torch.Tensor], float_keys: set[str]) -> None:
    """Assign `tensors` (the whole state, keys of the float linears' weights: `float_keys`) to `model`."""
    state = {k: (t.to(model.dtype) if k in float_keys else t) for k, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)


def float_model(model_class: type[DecoderLM], config: PretrainedConfig, rank: int, tensors: dict[str, torch.Tensor],
                float_keys: set[str]) -> tuple[DecoderLM, dict[str, str]]:
    """The rank's model with float linears holding `tensors` (keys of the quantized linears' float
    weights: `float_keys`); returns (model, weight key -> linear name). KV cache stays float."""
    float_kv = config.model_copy(update={"quantization": config.quantization.model_copy(
        update={"kv_cache_quant_algo": None})})
    model = model_class(float_kv, rank, device="meta")
    linears = unquantize_linears(model, {k: tuple(tensors[k].shape) for k in float_keys})
    if set(linears) != float_keys:
        raise ValueError(f"quantized linears {sorted(set(linears) ^ float_keys)[:3]} differ from the plan's")
    load_tensors(model, tensors, float_keys)
    model.eval()  # not prepare_for_inference: fused matmuls would bypass the Linears' hooks
    return model, {k: m.name for k, m in linears.items()}


def tuned_int4_codes(model: DecoderLM, tensors: dict[str, torch.Tensor], slots: dict, names: dict[str, str],
                     stats: dict[str, LinearInputStats], chunks: list[list[int]], targets: list,
                     steps: int, scale_dtype: torch.dtype, bar) -> dict[str, Int4Codes]:
    """Weight key -> int4 codes of every quantized linear: GPTQ on `tensors` (the folded weights),
    then `steps` steps of end-to-end scale tuning towards the float model's `targets` (core.convert.tune)."""
    from bestiary.core.convert.tune import tune_group_scales

    load_tensors(model, tensors, set(slots))  # the AWQ folds changed norms and weights
    gptq = bar.add_task("GPTQ", total=len(slots))
    layers = {}
    for key, slot in slots.items():
        layers[names[key]] = slot.int4_codes(tensors[key], scale_dtype, stats.get(names[key]))
        bar.advance(gptq)
    tune = bar.add_task("tune scales", total=steps)
    tuned = tune_group_scales(model, layers, chunks, targets, steps,
                              on_step=lambda loss: bar.update(tune, advance=1, description=f"tune scales (KL {loss:.4f})"))
    return {key: tuned[name] for key, name in names.items()}


def write_calibrated_rank(tmp: Path, plan, loader, config: PretrainedConfig, model_class: type[DecoderLM],
                          ids: list[int], method: str, bar, task, tune_steps: int = 0) -> None:
    """Write rank `plan.rank` with each quantized linear packed from its inputs' statistics (module docstring)."""
    from bestiary.core.convert.quantize import checkpoint_names, quantize_loaded
    from bestiary.core.convert.source_to_checkpoint import rank_writer
    from bestiary.core.convert.tune import TeacherTargets
    from bestiary.core.runtime.model import torch_dtype

    tensors: dict[str, torch.Tensor] = {}
    for target in plan.reads:
        tensors.update(loader.load(target, plan.sources[target.key], config.mapping.tp_size, plan.tp_rank))
        bar.advance(task)
    slots = plan.quantizers or {}
    model, names = float_model(model_class, config, plan.rank, tensors, set(slots))
    sequences = calibration_chunks(model, ids)  # the ones collect_linear_inputs runs
    calibrate = bar.add_task("calibrate", total=len(sequences))
    targets: list[TeacherTargets]
    stats, targets = calibrate_linears(model, ids, needs_hessian(config.quantization, method), set(names.values()),
                                       bool(tune_steps), tensors, config.model_dump_json(exclude={"quantization"}),
                                       on_chunk=lambda: bar.advance(calibrate))
    if is_gptq_int4(config.quantization, method):
        from bestiary.core.quant.awq_fold import fold_awq_scales, scale_folds

        def rtn(key: str, w: torch.Tensor) -> torch.Tensor:
            lq = slots[key].lq
            return int4_roundtrip(w, lq.group_size, lq.has_zero_point)

        folds = scale_folds(model, set(slots))
        search = bar.add_task("AWQ scales", total=len(folds))
        fold_awq_scales(tensors, folds, stats, names, rtn, on_fold=lambda: bar.advance(search))
    scale_dtype = torch_dtype(config.dtype)
    tuned = {}
    if tune_steps:
        tuned = tuned_int4_codes(model, tensors, slots, names, stats, sequences, targets, tune_steps,
                                 scale_dtype, bar)
    del model
    packing = bar.add_task("quantize", total=len(tensors))
    with rank_writer(tmp, plan) as writer:
        for key in list(tensors):
            tensor = tensors.pop(key)
            slot = slots.get(key)
            if slot is None:
                parts = {key: tensor}
            elif key in tuned:
                parts = checkpoint_names(key, slot.pack_int4(tuned[key], scale_dtype))
            else:
                parts = quantize_loaded(key, tensor, slot, scale_dtype, stats.get(names[key]))
            for name, part in parts.items():
                writer.write(name, part)
            bar.advance(packing)


def write_sharded_rank(tmp: Path, plan, whole: Path, config: PretrainedConfig, model_class: type[DecoderLM], bar,
                       task) -> None:
    """Write rank `plan.rank` as its part of the tp 1 checkpoint at `whole` (quantized and calibrated
    once, on the whole model): every target of the rank, KV scales included, is its tp 1 tensor (of the
    global layer index under pp) cut by core.convert.quantize.rank_part; a tied lm_head (absent from a
    tp 1 file) is cut from the embedding."""
    from dataclasses import replace

    from safetensors import safe_open

    from bestiary.core.convert.quantize import rank_part
    from bestiary.core.convert.source_to_checkpoint import rank_writer
    from bestiary.core.format.checkpoint import global_layer_key, rank_file

    model = model_class(config, plan.rank, device="meta")
    aliases, offset = model.source_aliases(), model.layer_offset
    plan = replace(plan, later=[])  # the KV scales too are cut from the tp 1 file
    with safe_open(str(rank_file(whole, 0)), "pt") as tp1, rank_writer(tmp, plan) as writer:
        keys = set(tp1.keys())
        for target in plan.targets:
            key = global_layer_key(target.key, offset)
            key = key if key in keys else aliases.get(key, key)
            writer.write(target.key, rank_part(target, tp1.get_tensor(key), config, plan.tp_rank))
            bar.advance(task)
