"""The KV cache scales a checkpoint should hold, measured independently of the calibration code."""

from __future__ import annotations

import torch
from parity import EngineRunner

from bestiary.core.convert.calibration import calibration_ids
from bestiary.core.runtime.engine import Engine


def expected_kv_scales(float_kv_engine: Engine, qmax: float) -> list[torch.Tensor]:
    """Per layer (amax |K|, amax |V|) / qmax [2] of an engine with a float KV cache (the same
    weights as the quantized checkpoint) over the default calibration ids."""
    config = float_kv_engine.model.config
    ids = calibration_ids(None, config.vocab_size, None, config.max_position_embeddings)
    runner = EngineRunner(float_kv_engine, max_tokens=len(ids))
    runner.feed(ids)
    return [torch.tensor([pool[layer].flatten(0, 1)[: len(ids)].abs().max().item() / qmax
                          for pool in (runner.kv.k, runner.kv.v)]) for layer in range(runner.kv.k.shape[0])]
