"""Shared helpers of the LoRA tests: PEFT adapters on tiny random models, and a step runner
that feeds one sequence through an engine's model with an adapter (imported as `lora_helpers`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.lora.adapter import LoraAdapter
from bestiary.core.lora.batch import AdapterStack, StepLora
from bestiary.core.runtime.kv_cache import KVCache, blocks_for


def peft_adapter(hf_model, directory: Path, seed: int = 0, b_scale: float = 1.0, **config):
    """A PeftModel around `hf_model` with seeded random A and B (B != 0), saved to `directory`."""
    import peft

    model = peft.get_peft_model(hf_model, peft.LoraConfig(init_lora_weights=False, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5 * (b_scale if "lora_B" in name else 1))
    model.save_pretrained(directory)
    return model.eval()


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """An adapter dir written by hand (modules PEFT cannot wrap): adapter_config.json + safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    return directory


class LoraRunner:
    """Feeds one sequence through `model` step by step with `adapter` (None: the base model)."""

    def __init__(self, model, adapter: LoraAdapter | None, max_tokens: int = 256, block_size: int = 16) -> None:
        self.model, self.block_size = model, block_size
        self.blocks = list(range(blocks_for(max_tokens, block_size)))
        self.kv = KVCache.for_model(model, len(self.blocks), block_size)
        self.stack = AdapterStack([adapter], model.dtype, "cpu") if adapter is not None else None
        self.tokens: list[int] = []

    @torch.inference_mode()
    def feed(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        start = len(self.tokens)
        self.tokens += ids
        meta = AttentionMetadata.build(
            [len(ids)], [start], [self.blocks], self.block_size,
            positions=self.model.position_ids(self.tokens, start, len(ids)), mask=self.model.mask_kind,
            prefix_lens=[self.model.prefix_len(self.tokens)] if self.model.mask_kind != "causal" else None)
        if self.stack is not None:
            meta.lora = StepLora(self.stack, [len(ids)], [0])
        return self.model(torch.tensor(ids), meta, self.kv, all_logits=all_logits).float()


def run_logits(model, adapter: LoraAdapter | None, prompt: list[int], decode: list[int]) -> torch.Tensor:
    """Logits [len(prompt) + len(decode), V]: the prompt in one step, then one token a step."""
    runner = LoraRunner(model, adapter)
    rows = [runner.feed(prompt, all_logits=True)]
    rows += [runner.feed([t]) for t in decode]
    return torch.cat(rows)


LLAMA = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def tiny_llama(seed: int = 0, **overrides):
    """A random HF LlamaForCausalLM (LLAMA's sizes, `overrides` on top), the same for the same seed."""
    import parity
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**LLAMA, **overrides})
    return parity.reinit_(transformers.LlamaForCausalLM(config), seed=seed)
