"""A tiny random HF LLaMA saved in several source formats, shared by the CLI/loader tests."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(tmp_path: Path, seed: int = 0, **overrides) -> Path:
    """Save a 2-layer HF LlamaForCausalLM (GQA 4/2, hidden 64) to tmp_path/'hf'; return the dir."""
    import parity
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    cfg.update(overrides)
    model = parity.reinit_(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)), seed)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    return out
