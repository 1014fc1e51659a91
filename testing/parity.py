"""Parity helpers: tiny random models vs bestiary engines (the conformance kit uses them too).

Every helper that converts or loads takes `registry=` (default: the installed plugins), so a
plugin that is not pip-installed can be tested. Imports torch (not the package's __init__).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.kv_cache import KVCache, blocks_for
from bestiary.registry import Registry

if TYPE_CHECKING:
    import transformers

    from bestiary.core.format.config import PretrainedConfig
    from bestiary.testing.references import HFReference

M = TypeVar("M", bound=torch.nn.Module)


def reinit_(model: M, seed: int = 0) -> M:
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


def save_hf(model: transformers.PreTrainedModel, tmp_path: Path, name: str = "hf") -> Path:
    """`model.save_pretrained(tmp_path / name)`; returns that directory."""
    out = tmp_path / name
    model.save_pretrained(out)
    return out


def convert_and_load(src: Path, tmp_path: Path, registry: Registry | None = None, **kwargs: Any) -> Engine:
    """Convert `src` to `tmp_path / "ckpt"` (keyword arguments: ConvertOptions' fields) and load it."""
    ckpt = tmp_path / "ckpt"
    convert(src, ckpt, ConvertOptions(**kwargs), show_progress=False, registry=registry)
    return Engine.load(ckpt, registry=registry)


class EngineRunner:
    """Feeds one sequence through an engine's model step by step with its own KV cache."""

    def __init__(self, engine: Engine, max_tokens: int = 512, block_size: int = 16) -> None:
        model = engine.model
        self.model, self.block_size = model, block_size
        self.device = next(model.parameters()).device  # ids and metadata go where the weights are
        self.blocks = list(range(blocks_for(max_tokens, block_size)))
        self.kv = KVCache.for_model(model, len(self.blocks), block_size)
        self.tokens: list[int] = []

    @torch.inference_mode()
    def feed(self, ids: list[int], all_logits: bool = False, position_shift: int = 0) -> torch.Tensor:
        """Append `ids`; logits [len(ids), V] (all_logits) or [1, V] of the last one.

        position_shift (a deliberate bug for the broken variants): every position after
        the first is moved by this much. A uniform shift would go unnoticed by RoPE,
        which only sees relative positions; this one changes the distances to token 0.
        """
        start = len(self.tokens)
        self.tokens += ids
        positions = self.model.position_ids(self.tokens, start, len(ids))
        positions = positions + position_shift * (positions > 0)
        meta = AttentionMetadata.build(
            [len(ids)], [start], [self.blocks], self.block_size, positions=positions,
            mask=self.model.mask_kind, device=self.device,
            prefix_lens=[self.model.prefix_len(self.tokens)] if self.model.mask_kind != "causal" else None,
        )
        logits: torch.Tensor = self.model(torch.tensor(ids, device=self.device), meta, self.kv, all_logits=all_logits)
        return logits.float().cpu()


def device_of(model: object) -> torch.device:
    """Where a reference model computes: its `device` (transformers models), else the CPU."""
    return torch.device(getattr(model, "device", "cpu"))


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF logits [len(ids), V] for one sequence (fp32, on the CPU; the model may sit on any device)."""
    with torch.no_grad():
        logits: torch.Tensor = hf_model(torch.tensor([ids], device=device_of(hf_model))).logits  # [1, T, V]
        return logits[0].float().cpu()


def prefill_and_decode_diffs(engine: Engine, hf_model: torch.nn.Module, prompt: list[int], steps: int = 8,
                             position_shift: int = 0) -> tuple[float, float]:
    """(max |ours - HF| over prefill + `steps` greedy decode steps, max |HF|)."""
    return reference_diffs(engine, lambda ids: hf_logits(hf_model, ids), prompt, steps, position_shift)


def reference_diffs(engine: Engine, logits: Callable[[list[int]], torch.Tensor], prompt: list[int],
                    steps: int = 8, position_shift: int = 0) -> tuple[float, float]:
    """(max |ours - reference|, max |reference|) over the prefill of `prompt` and `steps` decode steps
    that follow the reference's greedy tokens; `logits(ids)` is the reference's [len(ids), V]."""
    runner = EngineRunner(engine)
    ours = runner.feed(prompt, all_logits=True, position_shift=position_shift)
    ref = logits(prompt)
    worst, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    seq = list(prompt)
    for _ in range(steps):
        nxt = int(ref[-1].argmax())
        seq.append(nxt)
        ours = runner.feed([nxt], position_shift=position_shift)[0]
        ref = logits(seq)
        worst = max(worst, (ours - ref[-1]).abs().max().item())
        scale = max(scale, ref[-1].abs().max().item())
    return worst, scale


def mechanism_miss(reference: HFReference, engine: Engine, flip_hf: Callable[[bool], None],
                   flip_ours: Callable[[bool], None], steps: int = 1) -> tuple[float, float, float]:
    """(bound, max |HF with a mechanism off - HF|, max |ours with it off - HF|) over the kit's PROMPT (ours: its
    prefill and `steps` decode steps): flip_hf(False) / flip_ours(False) switch the mechanism off, (True) back on,
    whatever happens in between. A test of a mechanism (a window, a soft-cap, sink logits, a routing rule) asserts
    both moves are far past the bound: transformers' logits depend on it, and ours implement it."""
    from bestiary.testing.suite import PROMPT

    ref = hf_logits(reference.model, PROMPT)
    bound = tolerance(ref)
    try:
        flip_hf(False)
        hf_moved = (hf_logits(reference.model, PROMPT) - ref).abs().max().item()
    finally:
        flip_hf(True)
    try:
        flip_ours(False)
        ours_moved = reference_diffs(engine, reference.logits, PROMPT, steps)[0]
    finally:
        flip_ours(True)
    return bound, hf_moved, ours_moved


def assert_split_matches(reference: HFReference, source: Path, tp1: Engine, out: Path, steps: int,
                         **layout: int) -> None:
    """`source` converted to `out` with ConvertOptions(**layout) (tp_size, moe_ep_size): its ranks as asked,
    within the kit's bound of `reference` over the kit's PROMPT prefill + `steps` decode steps, and greedy
    tokens equal to the tp 1 engine `tp1`'s."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.suite import PROMPT

    greedy = SamplingConfig(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    (alone,) = LLM(tp1.directory, num_threads=1).generate([PROMPT], greedy)
    llm = LLM(convert(source, out, ConvertOptions(**layout), show_progress=False), num_threads=1)
    try:
        assert llm.engine.model.tp_size == layout.get("tp_size", 1)
        assert llm.engine.config.mapping.moe_ep_size == layout.get("moe_ep_size", 1)
        diff, scale = reference_diffs(llm.engine, reference.logits, PROMPT, steps)
        (split,) = llm.generate([PROMPT], greedy)
    finally:
        llm.close()
    assert diff <= 1e-4 * max(1.0, scale), f"{layout}: max|ours - HF| {diff:.3e}"
    assert split.output_ids == alone.output_ids


# --- greedy generation against HF ----------------------------------------------------------
def hf_greedy(hf_model: transformers.GenerationMixin, prompt: list[int],
              new_tokens: int) -> tuple[list[int], int | None]:
    """HF's greedy `generate` tokens (EOS ignored) and the first step whose top-2 logit
    margin is below 1e-3 * max|logit| (None when no step is that close to a tie)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt], device=device_of(hf_model)), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    assert not isinstance(out, torch.Tensor) and out.logits is not None  # return_dict_in_generate, output_logits
    tokens = out.sequences[0, len(prompt):].tolist()
    for step, logits in enumerate(out.logits):
        top2 = logits[0].float().topk(2).values
        if (top2[0] - top2[1]).item() < 1e-3 * logits[0].float().abs().max().item():
            return tokens, step
    return tokens, None


def greedy_mismatch(ours: list[int], ref: list[int], near_tie: int | None) -> str | None:
    """None when `ours` equals `ref` before the first near-tie step (all of it without one),
    else a message naming the first differing step."""
    end = len(ref) if near_tie is None else near_tie
    if ours[:end] == ref[:end]:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), end))
    return (f"greedy tokens differ at step {first} (first HF near-tie step: {near_tie}): "
            f"ours {ours} vs HF {ref}")


# --- TP/PP checkpoints ---------------------------------------------------------------------
def reassemble_checkpoint(ckpt: Path, registry: Registry | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors of a tp x pp checkpoint dir, keyed as a tp 1 / pp 1 checkpoint would be.

    Each rank's layers are renumbered to global indices; tp shards are concatenated along
    the tensor's tp dim; attention.qkv is re-assembled per q/k/v part (rank r's first kv
    head is r * KVH // tp, so a kv head replicated on several ranks is taken once, after
    checking the copies are equal); replicated tensors must be equal on every rank.
    """
    from bestiary.core.convert.loader import model_targets
    from bestiary.core.convert.source_to_checkpoint import instantiate
    from bestiary.core.format.checkpoint import load_rank_weights
    from bestiary.core.format.config import read_json
    from bestiary.core.runtime.engine import validate_model_config
    from bestiary.registry import default_registry

    config = validate_model_config(read_json(ckpt / "config.json"), str(ckpt), registry)
    spec = (registry or default_registry()).get(config.architecture)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    tp_dims: dict[str, int] = {}
    for rank in range(config.mapping.world_size):
        model = instantiate(spec, config, rank)
        weights = load_rank_weights(ckpt, rank)
        for target in model_targets(model):
            key = _global_layer_key(target.key, model.layer_offset)
            shards.setdefault(key, {})[model.tp_rank] = weights[target.key]
            tp_dims[key] = target.tp_dim
    return {key: _join_shards(key, [parts[r] for r in sorted(parts)], tp_dims[key], config)
            for key, parts in shards.items()}


def _global_layer_key(key: str, layer_offset: int) -> str:
    parts = key.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def _join_shards(key: str, tensors: list[torch.Tensor], tp_dim: int, config: PretrainedConfig) -> torch.Tensor:
    if tp_dim < 0 or len(tensors) == 1:
        assert all(torch.equal(t, tensors[0]) for t in tensors), f"{key}: replicated copies differ"
        return tensors[0]
    if ".attention.qkv." in key:
        return _join_qkv(key, tensors, config)
    return torch.cat(tensors, dim=tp_dim)


def _join_qkv(key: str, tensors: list[torch.Tensor], config: PretrainedConfig) -> torch.Tensor:
    tp, kvh, d = len(tensors), config.num_key_value_heads, config.head_size
    assert kvh is not None and d is not None  # PretrainedConfig's validator fills both
    q_rows = config.num_attention_heads // tp * d
    qs: list[torch.Tensor] = []
    ks: dict[int, torch.Tensor] = {}
    vs: dict[int, torch.Tensor] = {}
    for rank, tensor in enumerate(tensors):
        kv_rows = (tensor.shape[0] - q_rows) // 2
        q, k, v = torch.split(tensor, [q_rows, kv_rows, kv_rows])
        first = rank * kvh // tp
        if first in ks:
            same = torch.equal(ks[first], k) and torch.equal(vs[first], v)
            assert same, f"{key}: replicated kv head {first} differs"
        qs.append(q)
        ks[first], vs[first] = k, v
    return torch.cat(qs + [ks[i] for i in sorted(ks)] + [vs[i] for i in sorted(vs)])
