"""Mixtral (sparse MoE) against HF transformers' MixtralForCausalLM, fp32, tiny random weights.

The HF model is built in the test (4 experts, top-2, GQA), re-initialised by
`parity.reinit_` and saved with `save_pretrained` (per-expert w1/w2/w3 names).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from split_dims import DENSE_TP_DIMS, assert_split_dims  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

from bestiary.core.convert import source_to_checkpoint as convert_module  # noqa: E402
from bestiary.core.convert.loader import model_targets  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format.checkpoint import load_rank_weights  # noqa: E402
from bestiary.core.format.config import Mapping, read_json  # noqa: E402
from bestiary.core.format.errors import WeightsError  # noqa: E402
from bestiary.core.layers import moe as moe_module  # noqa: E402
from bestiary.core.layers.moe import MoE  # noqa: E402
from bestiary.core.runtime.engine import Engine, validate_model_config  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.models.mixtral.model import MixtralConfig, from_hf_config  # noqa: E402
from bestiary.registry import default_registry  # noqa: E402

HF_CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=256)
PROMPT = [5, 17, 99, 3, 42, 8, 61, 27, 11, 120, 7, 33, 2, 90]
NEW_TOKENS = 16


def no_renormalisation(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic Mixtral bug: softmax over all E logits, top-k, no renormalisation (whatever is asked)."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.topk(probs, top_k, dim=-1)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return parity.reinit_(transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF_CONFIG)))


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory) -> Path:
    return parity.save_hf(hf_model, tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixtral_ckpt") / "tp1"
    convert(hf_dir, out, show_progress=False)
    return out


# --- config ------------------------------------------------------------------------------


def test_hf_checkpoint_uses_per_expert_names(hf_dir):
    """What transformers' save_pretrained writes (the names the key map reads)."""
    keys = set(load_file(str(hf_dir / "model.safetensors")))
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= keys


def test_registry_claims_mixtral(hf_dir):
    spec = default_registry().for_hf_config(read_json(hf_dir / "config.json"), "config.json")
    assert spec.name == "MixtralForCausalLM"
    assert default_registry().for_hf_config({"model_type": "mixtral"}, "x").name == "MixtralForCausalLM"


def test_hf_defaults_and_every_field_written(ckpt):
    """An HF config without the optional fields gets HF MixtralConfig's defaults."""
    hf = transformers.MixtralConfig()
    config = from_hf_config({"architectures": ["MixtralForCausalLM"]}, "float32", Mapping())
    same = ["num_local_experts", "num_experts_per_tok", "num_key_value_heads", "intermediate_size",
            "vocab_size", "max_position_embeddings", "hidden_act", "hidden_size", "num_hidden_layers",
            "num_attention_heads"]
    for ours, theirs in [(name, name) for name in same] + [("norm_epsilon", "rms_norm_eps")]:
        assert getattr(config, ours) == getattr(hf, theirs), ours
    assert config.rotary_base == hf.rope_parameters["rope_theta"] == 1e6
    written = read_json(ckpt / "config.json")
    assert set(written) == set(MixtralConfig.model_fields)
    moe_fields = (written["num_local_experts"], written["num_experts_per_tok"], written["rotary_base"])
    assert moe_fields == (4, 2, 1e6)
    assert validate_model_config(written, "config.json") == from_hf_config(HF_CONFIG, "float32", Mapping())


def test_sliding_window_keeps_positions_and_bad_top_k_is_refused():
    """The window is an attention window (tests/runtime/test_attention_window.py), not a cap on the length."""
    config = from_hf_config(dict(HF_CONFIG, sliding_window=64), "float32", Mapping())
    assert (config.sliding_window, config.max_position_embeddings) == (64, 256)
    with pytest.raises(Exception, match="num_experts_per_tok 5 > num_local_experts 4"):
        from_hf_config(dict(HF_CONFIG, num_experts_per_tok=5), "float32", Mapping())


# --- the MoE block ---------------------------------------------------------------------


def ours_from_hf_block(block: MixtralSparseMoeBlock, tp_rank: int = 0, tp_size: int = 1) -> MoE:
    """Our MoE holding rank `tp_rank`'s slice of the HF block's weights."""
    cfg = HF_CONFIG
    inter, part = cfg["intermediate_size"], cfg["intermediate_size"] // tp_size
    ours = MoE(cfg["hidden_size"], inter, cfg["num_local_experts"], cfg["num_experts_per_tok"], "silu",
               tp_rank=tp_rank, tp_size=tp_size)
    local = slice(tp_rank * part, (tp_rank + 1) * part)
    gate_up = block.experts.gate_up_proj.detach()  # [E, 2I, H] = [gate_proj; up_proj]
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        ours.fc.weight.copy_(gate_up[:, :inter][:, local])
        ours.gate.weight.copy_(gate_up[:, inter:][:, local])
        ours.proj.weight.copy_(block.experts.down_proj[:, :, local])
    return ours


@pytest.fixture(scope="module")
def hf_block():
    block = MixtralSparseMoeBlock(transformers.MixtralConfig(**HF_CONFIG, experts_implementation="eager"))
    return parity.reinit_(block, seed=1)


def test_moe_block_matches_hf(hf_block, monkeypatch):
    """Our MoE layer == HF's MixtralSparseMoeBlock on the same weights (unfused, fused, TP 2)."""
    x = torch.randn(1, 37, HF_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_block(x)[0]  # [T, H]
    tol = parity.tolerance(ref)
    ours = ours_from_hf_block(hf_block)
    assert (ours(x[0]) - ref).abs().max().item() <= tol
    ours.fuse()
    assert (ours(x[0]) - ref).abs().max().item() <= tol
    # tensor parallel: each rank's partial output over its I/2 slice of every expert sums to y
    partials = [ours_from_hf_block(hf_block, rank, 2).partial_forward(x[0]) for rank in range(2)]
    assert (sum(partials) - ref).abs().max().item() <= tol
    monkeypatch.setattr(moe_module, "route", no_renormalisation)
    assert (ours(x[0]) - ref).abs().max().item() >= 100 * tol


# --- parity of the whole model ---------------------------------------------------------


def test_logits_parity_prefill_and_decode(ckpt, hf_model, monkeypatch):
    """Prefill + 8 greedy decode steps within 1e-4 * max|ref|; rope off / bad routing miss by 100x."""
    worst, scale = parity.prefill_and_decode_diffs(Engine.load(ckpt), hf_model, PROMPT)
    tol = parity.tolerance(torch.tensor([scale]))
    print(f"mixtral parity: max diff {worst:.3g}, tolerance {tol:.3g}, ratio {worst / tol:.3g}")
    assert worst <= tol

    broken = Engine.load(ckpt)
    for layer in broken.model.transformer.layers:
        layer.attention.rotary = None
    rope_off, _ = parity.prefill_and_decode_diffs(broken, hf_model, PROMPT)
    monkeypatch.setattr(moe_module, "route", no_renormalisation)
    bad_routing, _ = parity.prefill_and_decode_diffs(Engine.load(ckpt), hf_model, PROMPT)
    print(f"mixtral broken: rope off {rope_off / tol:.3g}x, no renormalisation {bad_routing / tol:.3g}x")
    assert rope_off >= 100 * tol
    assert bad_routing >= 100 * tol


def hf_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], int]:
    """HF greedy tokens and the first step whose top-2 margin < 1e-3 * max|logit| (steps if none)."""
    seq, first_close = list(prompt), steps
    for step in range(steps):
        logits = parity.hf_logits(hf_model, seq)[-1]
        top2 = torch.topk(logits, 2).values
        if first_close == steps and (top2[0] - top2[1]).item() < 1e-3 * logits.abs().max().item():
            first_close = step
        seq.append(int(logits.argmax()))
    return seq[len(prompt):], first_close


def test_greedy_generation_equals_hf(ckpt, hf_model):
    """LLM(ckpt).generate greedy == HF greedy up to the first near-tie of HF's top-2 logits."""
    expected, first_close = hf_greedy(hf_model, PROMPT, NEW_TOKENS)
    sampling = SamplingConfig(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    (completion,) = LLM(ckpt).generate([PROMPT], sampling)
    print(f"mixtral greedy: first near-tie step {first_close} of {NEW_TOKENS}: {expected}")
    assert first_close > NEW_TOKENS // 2  # the comparison must cover most of the steps
    assert completion.output_ids[:first_close] == expected[:first_close]


# --- conversion: TP / PP shards, strictness --------------------------------------------


def reassemble(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The tp 1 / pp 1 tensors of a sharded checkpoint: TP slices concatenated, PP layers renumbered."""
    config = validate_model_config(read_json(ckpt_dir / "config.json"), "config.json")
    spec = default_registry().get(config.architecture)
    tp = config.mapping.tp_size
    parts: dict[str, list[torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for rank in range(config.mapping.world_size):
        model = convert_module.instantiate(spec, config, rank)
        weights = load_rank_weights(ckpt_dir, rank)
        for target in model_targets(model):
            key = global_key(target.key, model.layer_offset)
            parts.setdefault(key, []).append(weights[target.key])
            dims[key] = target.tp_dim
    heads, kv = config.num_attention_heads // tp, config.num_key_value_heads // tp
    sizes = [heads * config.head_size, kv * config.head_size, kv * config.head_size]
    full = {}
    for key, tensors in parts.items():
        assert len(tensors) == tp, key
        if key.endswith("attention.qkv.weight"):  # each rank holds [Q_r; K_r; V_r]
            split = [t.split(sizes) for t in tensors]
            full[key] = torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
        elif dims[key] < 0:
            assert all(torch.equal(t, tensors[0]) for t in tensors), f"{key} differs across tp ranks"
            full[key] = tensors[0]
        else:
            full[key] = torch.cat(tensors, dim=dims[key])
    return full


def global_key(key: str, layer_offset: int) -> str:
    """transformer.layers.<local>.x -> transformer.layers.<local + offset>.x."""
    sections = key.split(".")
    if len(sections) > 2 and sections[1] == "layers":
        sections[2] = str(int(sections[2]) + layer_offset)
    return ".".join(sections)


# Experts [E, out, in] split along I: fc / gate along out (1), proj along in (2); router replicated.
TP_DIMS = {**DENSE_TP_DIMS, "transformer.layers.*.mlp.router.weight": -1,
           "transformer.layers.*.mlp.fc.weight": 1, "transformer.layers.*.mlp.gate.weight": 1,
           "transformer.layers.*.mlp.proj.weight": 2}


@pytest.mark.parametrize("tp_size, pp_size", [(2, 1), (1, 2), (2, 2)])
def test_sharded_conversion_reassembles_to_tp1(hf_dir, ckpt, tmp_path, tp_size, pp_size):
    """--tp_size / --pp_size shards re-assemble to the tp 1 tensors; experts split along I."""
    out = convert(hf_dir, tmp_path / "sharded", ConvertOptions(tp_size=tp_size, pp_size=pp_size), show_progress=False)
    reference = load_rank_weights(ckpt, 0)
    full = reassemble(out)
    assert set(full) == set(reference)
    assert_split_dims(out, reference, TP_DIMS, tp_size)
    for key, tensor in reference.items():
        assert torch.equal(full[key], tensor), key
    rank0 = load_rank_weights(out, 0)
    experts, inter = HF_CONFIG["num_local_experts"], HF_CONFIG["intermediate_size"]
    hidden = HF_CONFIG["hidden_size"]
    assert rank0["transformer.layers.0.mlp.fc.weight"].shape == (experts, inter // tp_size, hidden)
    assert rank0["transformer.layers.0.mlp.proj.weight"].shape == (experts, hidden, inter // tp_size)
    assert rank0["transformer.layers.0.mlp.router.weight"].shape == (experts, hidden)


def resave_with(hf_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the HF dir whose model.safetensors went through `edit(tensors)`."""
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_unused_source_key_fails_naming_it(hf_dir, tmp_path):
    """A fifth expert the config does not declare is an unused source tensor."""
    extra = "model.layers.1.block_sparse_moe.experts.4.w1.weight"

    def add_expert(tensors):
        tensors[extra] = tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"].clone()

    with pytest.raises(WeightsError, match=f"'{extra}' is not used"):
        convert(resave_with(hf_dir, tmp_path, add_expert), tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_expert_fails_naming_it(hf_dir, tmp_path):
    missing = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    with pytest.raises(WeightsError, match=f"'{missing}' .*not found"):
        convert(resave_with(hf_dir, tmp_path, lambda t: t.pop(missing)), tmp_path / "out",
                show_progress=False)
