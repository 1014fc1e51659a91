"""Shared helpers of the parity tests: tiny random HF models vs bestiary engines.

Imported by test modules as `import parity` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bestiary.core.convert import convert
from bestiary.core.engine import Engine
from bestiary.core.kv_cache import KVCache, blocks_for
from bestiary.core.layers.attention import AttentionMetadata


def reinit_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights ~ N(0, 1/fan_in) (matrices), norms ~ N(1, 0.1), biases ~ N(0, 0.1): bugs show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif "norm" in name or "ln" in name.split(".")[-2]:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def tolerance(ref: torch.Tensor) -> float:
    """The parity bound: 1e-4 * max(1, max|ref|)."""
    return 1e-4 * max(1.0, ref.abs().max().item())


def save_hf(model, tmp_path: Path, name: str = "hf") -> Path:
    out = tmp_path / name
    model.save_pretrained(out)
    return out


def convert_and_load(src: Path, tmp_path: Path, **kwargs) -> Engine:
    ckpt = tmp_path / "ckpt"
    convert(src, ckpt, show_progress=False, **kwargs)
    return Engine.load(ckpt)


class EngineRunner:
    """Feeds one sequence through an engine's model step by step with its own KV cache."""

    def __init__(self, engine: Engine, max_tokens: int = 512, block_size: int = 16) -> None:
        model = engine.model
        cfg = model.config
        self.model, self.block_size = model, block_size
        self.blocks = list(range(blocks_for(max_tokens, block_size)))
        self.kv = KVCache(len(model.transformer.layers), len(self.blocks), block_size,
                          cfg.num_key_value_heads // model.tp_size, cfg.head_size, model.dtype)
        self.tokens: list[int] = []

    @torch.inference_mode()
    def feed(self, ids: list[int], all_logits: bool = False, position_shift: int = 0) -> torch.Tensor:
        """Append `ids`; logits [len(ids), V] (all_logits) or [1, V] of the last one."""
        start = len(self.tokens)
        self.tokens += ids
        positions = self.model.position_ids(self.tokens, start, len(ids)) + position_shift
        meta = AttentionMetadata.build(
            [len(ids)], [start], [self.blocks], self.block_size, positions=positions,
            mask=self.model.mask_kind,
            prefix_lens=[self.model.prefix_len(self.tokens)] if self.model.mask_kind != "causal" else None,
        )
        return self.model(torch.tensor(ids), meta, self.kv, all_logits=all_logits).float()


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """HF logits [len(ids), V] for one sequence (fp32)."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def prefill_and_decode_diffs(engine: Engine, hf_model, prompt: list[int], steps: int = 8,
                             position_shift: int = 0) -> tuple[float, float]:
    """(max |ours - HF| over prefill + `steps` greedy decode steps, max |HF|)."""
    runner = EngineRunner(engine)
    ours = runner.feed(prompt, all_logits=True, position_shift=position_shift)
    ref = hf_logits(hf_model, prompt)
    worst, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    seq = list(prompt)
    for _ in range(steps):
        nxt = int(ref[-1].argmax())
        seq.append(nxt)
        ours = runner.feed([nxt], position_shift=position_shift)[0]
        ref = hf_logits(hf_model, seq)
        worst = max(worst, (ours - ref[-1]).abs().max().item())
        scale = max(scale, ref[-1].abs().max().item())
    return worst, scale
