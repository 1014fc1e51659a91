"""KV cache scales at convert, measured on the converted model itself.

After every rank file is written (the KV scale tensors as placeholders), the checkpoint's
model is loaded with a float KV cache, run over the calibration tokens (core.convert.calibration:
at most CALIB_TOKENS of `--calib_text` or the short built-in data/kv_calibration.txt), and each
layer's kv_cache_scaling_factor is overwritten in place with amax / qmax (core.quant.kv).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from bestiary.core.convert.calibration import run_sequence
from bestiary.core.format.checkpoint import SAFETENSORS_DTYPES, load_rank_weights, rank_file
from bestiary.core.format.config import PretrainedConfig
from bestiary.core.quant.kv import SCALE_NAME, scales_from_amax
from bestiary.core.runtime.model import DecoderLM


@torch.inference_mode()
def calibrate_kv_amax(model: DecoderLM, ids: list[int], block_size: int = 32) -> list[tuple[float, float]]:
    """(amax |K|, amax |V|) per local layer of `model` (float KV cache) over one pass of `ids`."""
    _, kv = run_sequence(model, ids, all_logits=False, block_size=block_size)
    return [(kv.k[i].abs().amax().item(), kv.v[i].abs().amax().item()) for i in range(kv.k.shape[0])]


def copy_kv_scales(tp1_dir: Path, directory: Path, config: PretrainedConfig) -> None:
    """Write the KV scales calibrated in the tp 1 checkpoint `tp1_dir` into every rank file of
    `directory` (a layer's scale is replicated: one amax over all kv heads, as at tp 1); a pipeline
    stage's file takes its own layers' scales under their local indices."""
    from bestiary.core.format.checkpoint import global_layer_key
    from bestiary.core.runtime.model import pp_layer_range

    scales = {k: v for k, v in load_rank_weights(tp1_dir, 0).items() if k.endswith(f".{SCALE_NAME}")}
    m = config.mapping
    for rank in range(m.world_size):
        offset = pp_layer_range(config.num_hidden_layers, m.pp_size, m.pp_rank(rank)).start
        with safe_open(str(rank_file(directory, rank)), "pt") as f:
            local = [k for k in f.keys() if k.endswith(f".{SCALE_NAME}")]
        for key in local:
            patch_tensor(rank_file(directory, rank), key, scales[global_layer_key(key, offset)])


def patch_tensor(path: Path, key: str, tensor: torch.Tensor) -> None:
    """Overwrite tensor `key` of a closed .safetensors file in place (same dtype and shape)."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(length))[key]
        if entry["dtype"] != SAFETENSORS_DTYPES[tensor.dtype] or entry["shape"] != list(tensor.shape):
            raise ValueError(f"{path}: {key} is {entry['dtype']} {entry['shape']}, not {tensor.dtype} {list(tensor.shape)}")
        f.seek(8 + length + entry["data_offsets"][0])
        f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def calibrate_kv_scales(directory: Path, config: PretrainedConfig, model_class: type[DecoderLM],
                        ids: list[int]) -> list[torch.Tensor]:
    """Measure and write every layer's kv_cache_scaling_factor of the checkpoint at `directory`."""
    algo = config.quantization.kv_cache_quant_algo
    assert algo is not None, "calibrate_kv_scales: for a quantized KV cache only"
    float_kv = config.model_copy(update={"quantization": config.quantization.model_copy(
        update={"kv_cache_quant_algo": None})})
    with torch.device("meta"):
        model = model_class(float_kv, 0, device="meta")
    weights = {k: v for k, v in load_rank_weights(directory, 0).items() if not k.endswith(f".{SCALE_NAME}")}
    model.load_state_dict(weights, strict=True, assign=True)
    model.eval()
    model.prepare_for_inference()
    from bestiary.core.layers.attention import PagedAttention

    owners = [path for path, m in model.named_modules() if isinstance(getattr(m, "attn", None), PagedAttention)]
    amax = calibrate_kv_amax(model, ids)
    scales = [scales_from_amax(a, algo) for a in amax]
    for path, s in zip(owners, scales, strict=True):
        patch_tensor(rank_file(directory, 0), f"{path}.{SCALE_NAME}", s)
    return scales
