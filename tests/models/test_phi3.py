"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM) against transformers' Phi3ForCausalLM: tiny random models, fp32,
the conformance kit over the prefill and 16 greedy decode steps, one case per variant (PHI3); W8A16 / W4A16
against the LLaMA engine of the same weights; the fused qkv_proj / gate_up_proj hooks at tp 2; what the config
reader accepts and refuses.

LongRoPE's own checks (its switch, its scaling, the KV cache across the switch) are in test_phi3_longrope.py.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from bestiary.core.format.config import Mapping  # noqa: E402
from bestiary.core.format.errors import ConfigError  # noqa: E402
from bestiary.models.phi3.model import from_hf_config  # noqa: E402
from bestiary.testing import conformance  # noqa: E402

TINY = dict(model_type="phi3", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def longrope(pairs: int, original: int) -> dict:
    """A longrope scaling over `pairs` rotary pairs whose short and long divisors differ on every pair but
    the first, switching at `original` tokens."""
    return dict(original_max_position_embeddings=original,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
                              "long_factor": [1.0 + 1.5 * i for i in range(pairs)]})


# The conformance prompt has 12 tokens and 16 decode steps follow (28 in all): "mini_128k" switches at 8, so
# every token uses the long divisors; "longrope_short" at 64, so every one uses the short ones. Both scale
# cos / sin (max / original = 32 and 4). "phi4_mini": partial rotary 0.75 (12 of 16 dims, 6 pairs), tied.
PHI3 = {
    "mini_4k_window": TINY | dict(num_key_value_heads=4, max_position_embeddings=128, sliding_window=8),
    "mini_128k_longrope": TINY | dict(num_key_value_heads=4, max_position_embeddings=256) | longrope(8, 8),
    "longrope_short": TINY | dict(num_key_value_heads=2, max_position_embeddings=256) | longrope(8, 64),
    "phi4_gqa": TINY | dict(num_key_value_heads=2, max_position_embeddings=128, rope_theta=250000.0),
    "phi4_mini_partial_tied": TINY | dict(num_key_value_heads=2, max_position_embeddings=256,
                                          partial_rotary_factor=0.75, tie_word_embeddings=True) | longrope(6, 8),
}
# the LongRoPE variants run the kit in test_phi3_longrope.py (each file stays small)
LONGROPE_CASES = ("mini_128k_longrope", "longrope_short", "phi4_mini_partial_tied")
TestPhi3 = conformance("Phi3ForCausalLM", {k: v for k, v in PHI3.items() if k not in LONGROPE_CASES}, steps=16)


def hf_dict(**changes) -> dict:
    """A Phi-3 config.json dict (the 128k variant's fields) with `changes`."""
    base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 96, "hidden_size": 64,
            "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 256, "original_max_position_embeddings": 8}
    return base | changes


def read(**changes):
    return from_hf_config(hf_dict(**changes), "float32", Mapping(), source="/data/phi3")


def test_reader_takes_old_longrope_names_and_the_top_level_switch_length():
    """Phi3Config's rules: "su" / "yarn" are longrope, the top-level original_max_position_embeddings wins over
    the dict's, and without any the switch length is 4096."""
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for kind in ("su", "yarn", "longrope"):
        scaling = read(rope_scaling={"type": kind, **factors, "original_max_position_embeddings": 99}).rotary_scaling
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 8, kind
    hf = hf_dict(rope_scaling={"type": "longrope", **factors})
    del hf["original_max_position_embeddings"]
    assert from_hf_config(hf, "float32", Mapping()).rotary_scaling["original_max_position_embeddings"] == 4096
    assert read().rotary_scaling is None  # Phi-3-mini-4k, Phi-4: the default rope


def test_reader_refuses_other_rope_kinds_in_one_line():
    with pytest.raises(ConfigError) as err:
        read(rope_scaling={"rope_type": "linear", "factor": 2.0})
    message = str(err.value)
    assert "/data/phi3" in message and "'linear'" in message and "longrope" in message and "\n" not in message


def test_wrong_factor_count_is_one_config_error():
    """short_factor / long_factor must hold rot_dim/2 numbers: a wrong count is one line naming the source and the
    field when the config is read, and the rotary refuses it too."""
    from bestiary.core.layers.rotary import Rotary

    factors = {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}
    with pytest.raises(ConfigError) as err:
        read(rope_scaling=factors)
    message = str(err.value)
    assert message.startswith("/data/phi3: cannot derive field 'rotary_scaling'") and "\n" not in message
    assert "short_factor must be a list of rot_dim/2 = 8 numbers (got 7)" in message
    scaling = {**factors, "rope_type": "longrope", "original_max_position_embeddings": 8}
    with pytest.raises(ConfigError, match=r"short_factor must be a list of rot_dim/2 = 8 numbers \(got 7\)"):
        Rotary(16, 16, 10000.0, scaling, 256)


def llama_twin(phi3: torch.nn.Module) -> torch.nn.Module:
    """transformers' LLaMA with the weights of a (default-rope) Phi-3: qkv_proj split into q/k/v_proj, gate_up_proj
    into gate/up_proj."""
    import transformers

    c = phi3.config
    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_parameters["rope_theta"], rms_norm_eps=c.rms_norm_eps, pad_token_id=0))
    d = c.hidden_size // c.num_attention_heads
    state = {}
    for key, value in phi3.state_dict().items():
        if "qkv_proj" in key:
            sizes = [c.num_attention_heads * d, c.num_key_value_heads * d, c.num_key_value_heads * d]
            state |= {key.replace("qkv", name): t for name, t in zip("qkv", value.split(sizes))}
        elif "gate_up_proj" in key:
            state |= {key.replace("gate_up", name): t for name, t in zip(("gate", "up"), value.chunk(2))}
        else:
            state[key] = value
    twin.load_state_dict(state, strict=True)
    return twin.eval()


@pytest.mark.parametrize("algo", ["W8A16", pytest.param("W4A16", marks=pytest.mark.slow)])  # a W4A16 convert: 20 s
def test_weight_only_quant_is_llamas_on_the_same_weights(algo, tmp_path):
    """W8A16 / W4A16 (group 32) of Phi-4-like GQA: bit-identical to the LLaMA engine of the same weights (the fused
    projections add nothing to the shared quantization), finite, off fp32 by a sanity bound only: int4 RTN of
    tiny random weights is far from parity (measured max|diff| 0.08 / 1.15 of a logit range 3.7 / 3.2)."""
    from bestiary.core.format.config import QuantConfig
    from bestiary.testing.parity import EngineRunner, convert_and_load, save_hf
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(PHI3["phi4_gqa"])
    quant = QuantConfig(quant_algo=algo, group_size=32)
    outs = [EngineRunner(convert_and_load(save_hf(model, tmp_path / name), tmp_path / name, quantization=quant))
            .feed(PROMPT, all_logits=True) for name, model in (("phi3", reference.model),
                                                               ("llama", llama_twin(reference.model)))]
    assert torch.equal(outs[0], outs[1])
    ref = reference.logits(PROMPT)
    diff, scale = (outs[0] - ref).abs().max().item(), ref.abs().max().item()
    assert torch.isfinite(outs[0]).all() and 0.0 < diff <= 0.5 * max(1.0, scale), f"{algo} {diff:.3e} vs {scale:.3e}"


def test_fused_projections_split_per_rank(tmp_path):
    """At tp 2 each rank holds [Q_r; K_r; V_r] of qkv_proj and its rows of each half of gate_up_proj (GQA: one kv
    head per rank), exactly the rows of the HF tensors."""
    from safetensors.torch import load_file

    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.checkpoint import load_rank_weights
    from bestiary.testing.references import as_reference

    source = as_reference(PHI3["phi4_gqa"]).save(tmp_path / "src")
    hf = {k: v for f in source.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    ckpt = convert(source, tmp_path / "tp2", ConvertOptions(tp_size=2), show_progress=False)
    qkv, gate_up = hf["model.layers.1.self_attn.qkv_proj.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([64, 32, 32])  # H D, KVH D, KVH D with D 16
    gate, up = gate_up.chunk(2)
    for rank in (0, 1):
        w = load_rank_weights(ckpt, rank)
        rows = slice(32 * rank, 32 * (rank + 1))
        expected = torch.cat([q[rows], k[16 * rank:16 * (rank + 1)], v[16 * rank:16 * (rank + 1)]])
        assert torch.equal(w["transformer.layers.1.attention.qkv.weight"], expected)
        assert torch.equal(w["transformer.layers.1.mlp.fc.weight"], gate[40 * rank:40 * (rank + 1)])
        assert torch.equal(w["transformer.layers.1.mlp.gate.weight"], up[40 * rank:40 * (rank + 1)])


# The published configs' shapes (factor values made up; only their count, rot_dim/2, matters here).
PUBLISHED = {
    "Phi-3.5-mini": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32064, max_position_embeddings=131072,
                         original_max_position_embeddings=4096, sliding_window=262144, rope_theta=10000.0,
                         rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}),
    "Phi-4": dict(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=10, vocab_size=100352, max_position_embeddings=16384,
                  original_max_position_embeddings=16384, rope_theta=250000.0, rope_scaling=None),
    "Phi-4-mini": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                       num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                       original_max_position_embeddings=4096, partial_rotary_factor=0.75, tie_word_embeddings=True,
                       rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}),
}
EXPECTED_ROTARY = {"Phi-3.5-mini": (96, 96, math.sqrt(1 + math.log(32) / math.log(4096))),
                   "Phi-4": (128, 128, None), "Phi-4-mini": (128, 96, math.sqrt(1 + math.log(32) / math.log(4096)))}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_build_with_their_rotary(name):
    """Each published variant's config.json reads and builds (meta device) with its head size, rotary dims and
    LongRoPE scale a = sqrt(1 + ln(131072 / 4096) / ln 4096) (none for Phi-4)."""
    from bestiary.models.phi3.model import Phi3ForCausalLM

    config = from_hf_config({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **PUBLISHED[name]},
                            "bfloat16", Mapping(), source=name)
    rotary = Phi3ForCausalLM(config, 0, device="meta").transformer.layers[0].attention.rotary
    head, rot, scale = EXPECTED_ROTARY[name]
    assert (config.head_size, rotary.rot_dim) == (head, rot)
    assert (rotary.longrope is None) if scale is None else rotary.longrope.attention_factor == pytest.approx(scale)
