"""ChatGLM v1 and v2/3 against references, fp32, tiny random weights.

v2/3: transformers' GlmForCausalLM (re-initialised by `parity.reinit_`) is the reference.
It is converted from its own `glm` naming and from the same weights re-saved here under
THUDM chatglm2/3 names (fused query_key_value, dense_h_to_4h = [gate; up], output_layer,
both the multi-query [Q; K; V] layout and the per-head [q, k, v] layout of
multi_query_attention false).

v1: transformers has no ChatGLM-6B class. The reference is `ChatGLMv1Reference` below, an
independent plain-torch transcription of the equations of THUDM's chatglm-6b
modeling_chatglm.py (per-head interleaved qkv, 2D rotary with [gMASK]/bos position ids,
prefix-LM mask filled with -10000, (l+1) score scaling, alpha = sqrt(2 L) residuals,
tanh GELU), run on its own random weights saved in THUDM v1 naming.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import parity
from safetensors.torch import load_file, save_file
from split_dims import DENSE_TP_DIMS, assert_split_dims

from bestiary.core.convert.loader import model_targets
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert, instantiate
from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.config import Mapping, read_json
from bestiary.core.format.errors import BestiaryError, ConfigError, WeightsError
from bestiary.core.runtime.engine import Engine, validate_model_config
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.models.chatglm.model import ChatGLM2Config, ChatGLMConfig, from_hf_config_v1, from_hf_config_v2
from bestiary.plugins import hookimpl
from bestiary.registry import Registry, default_registry

V1, V2 = "ChatGLMForCausalLM", "ChatGLM2ForCausalLM"
GLM_CONFIG = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
V2_PROMPT = [3, 17, 45, 8, 90, 22, 61, 5, 33, 71]

V1_CONFIG = {
    "architectures": ["ChatGLMModel"],
    "model_type": "chatglm",
    "vocab_size": 80,
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "inner_hidden_size": 128,
    "layernorm_epsilon": 1e-5,
    "max_sequence_length": 256,
    "bos_token_id": 70,
    "eos_token_id": 71,
    "mask_token_id": 68,
    "gmask_token_id": 69,
    "pad_token_id": 0,
    "position_encoding_2d": True,
    "quantization_bit": 0,
    "pre_seq_len": None,
    "torch_dtype": "float32",
}
V1_PROMPT = [3, 17, 45, 8, 60, 22, 31, 69, 70]  # ... [gMASK] bos
NEW_TOKENS = 12


# --- v2/3 sources ---------------------------------------------------------------------------


def thudm_v2_config(hf: dict, mqa: bool) -> dict:
    """A THUDM chatglm2/3-style config.json for the transformers GlmConfig dict `hf`."""
    return {
        "architectures": ["ChatGLMModel"],
        "model_type": "chatglm",
        "num_layers": hf["num_hidden_layers"],
        "padded_vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "kv_channels": hf["head_dim"],
        "num_attention_heads": hf["num_attention_heads"],
        "seq_length": hf["max_position_embeddings"],
        "layernorm_epsilon": hf["rms_norm_eps"],
        "rmsnorm": True,
        "apply_residual_connection_post_layernorm": False,
        "post_layer_norm": True,
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "multi_query_attention": mqa,
        "multi_query_group_num": hf["num_key_value_heads"],
        "rope_ratio": 1,
        "original_rope": True,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }


def per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[Q; K; V] -> rows [q_0 k_0 v_0 q_1 ...] (THUDM's non-MQA / v1 fused layout)."""
    parts = [t.reshape(-1, head_dim, *t.shape[1:]) for t in (q, k, v)]  # [n, D, ...] each
    return torch.stack(parts, dim=1).reshape(-1, *q.shape[1:])


def thudm_v2_weights(hf_model, mqa: bool) -> dict[str, torch.Tensor]:
    """The GlmForCausalLM weights under THUDM chatglm2/3 names (inv_freq included, as THUDM saves it)."""
    sd = hf_model.state_dict()
    cfg = hf_model.config
    out = {
        "transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
        "transformer.output_layer.weight": sd["lm_head.weight"],
        "transformer.rotary_pos_emb.inv_freq": torch.ones(cfg.head_dim // 4),
    }
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (sd[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            fused = torch.cat([q, k, v]) if mqa else per_head(q, k, v, cfg.head_dim)
            out[f"{dst}self_attention.query_key_value.{kind}"] = fused
        out[f"{dst}self_attention.dense.weight"] = sd[f"{src}self_attn.o_proj.weight"]
        out[f"{dst}mlp.dense_h_to_4h.weight"] = sd[f"{src}mlp.gate_up_proj.weight"]
        out[f"{dst}mlp.dense_4h_to_h.weight"] = sd[f"{src}mlp.down_proj.weight"]
        out[f"{dst}input_layernorm.weight"] = sd[f"{src}input_layernorm.weight"]
        out[f"{dst}post_attention_layernorm.weight"] = sd[f"{src}post_attention_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def write_source(directory: Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def glm_model(kv_heads: int, seed: int):
    torch.manual_seed(seed)
    config = transformers.GlmConfig(**{**GLM_CONFIG, "num_key_value_heads": kv_heads})
    return parity.reinit_(transformers.GlmForCausalLM(config), seed=seed)


# --- v1 reference -----------------------------------------------------------------------------


def v1_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random chatglm-6b weights in THUDM naming: matrices N(0, 1/fan_in), LN N(1, 0.1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inner, vocab = cfg["hidden_size"], cfg["inner_hidden_size"], cfg["vocab_size"]

    def mat(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    def vec(n: int, mean: float = 0.0) -> torch.Tensor:
        return mean + 0.1 * torch.randn(n, generator=gen)

    w = {
        "transformer.word_embeddings.weight": mat(vocab, hidden),
        "lm_head.weight": mat(vocab, hidden),
        "transformer.final_layernorm.weight": vec(hidden, 1.0),
        "transformer.final_layernorm.bias": vec(hidden),
    }
    hn = hidden // cfg["num_attention_heads"]
    for i in range(cfg["num_layers"]):
        p = f"transformer.layers.{i}."
        w |= {
            p + "input_layernorm.weight": vec(hidden, 1.0),
            p + "input_layernorm.bias": vec(hidden),
            p + "attention.query_key_value.weight": mat(3 * hidden, hidden),
            p + "attention.query_key_value.bias": vec(3 * hidden),
            p + "attention.dense.weight": mat(hidden, hidden),
            p + "attention.dense.bias": vec(hidden),
            p + "attention.rotary_emb.inv_freq": 1.0
            / 10000 ** (torch.arange(0, hn // 2, 2).float() / (hn // 2)),
            p + "post_attention_layernorm.weight": vec(hidden, 1.0),
            p + "post_attention_layernorm.bias": vec(hidden),
            p + "mlp.dense_h_to_4h.weight": mat(inner, hidden),
            p + "mlp.dense_h_to_4h.bias": vec(inner),
            p + "mlp.dense_4h_to_h.weight": mat(hidden, inner),
            p + "mlp.dense_4h_to_h.bias": vec(hidden),
        }
    return w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


class ChatGLMv1Reference(torch.nn.Module):
    """THUDM chatglm-6b's forward, in plain torch, for one sequence without a KV cache."""

    def __init__(self, weights: dict[str, torch.Tensor], cfg: dict) -> None:
        super().__init__()
        self.w, self.cfg = weights, cfg

    def positions(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """THUDM get_position_ids (position_encoding_2d) and the context length."""
        c = self.cfg
        ctx = tokens.index(c["bos_token_id"])
        mask_token = c["gmask_token_id"] if c["gmask_token_id"] in tokens else c["mask_token_id"]
        pos = torch.arange(len(tokens))
        pos[ctx:] = tokens.index(mask_token)
        block = torch.cat([torch.zeros(ctx, dtype=torch.long), torch.arange(len(tokens) - ctx) + 1])
        return pos, block, ctx

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        w, c = self.w, self.cfg
        tokens = ids[0].tolist()
        t, heads, layers = len(tokens), c["num_attention_heads"], c["num_layers"]
        hn = c["hidden_size"] // heads
        pos, block, ctx = self.positions(tokens)
        keep = torch.ones(t, t).tril()
        keep[:, :ctx] = 1
        masked = keep < 0.5  # [T, T]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, hn // 2, 2).float() / (hn // 2)))
        freqs = torch.outer(torch.arange(c["max_sequence_length"]).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # [P, hn/2]
        alpha = (2 * layers) ** 0.5
        eps = c["layernorm_epsilon"]
        h = w["transformer.word_embeddings.weight"][ids[0]]  # [T, H]

        def ln(x, name):
            return F.layer_norm(x, (x.shape[-1],), w[name + ".weight"], w[name + ".bias"], eps)

        def lin(x, name):
            return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

        def rope(x, p):  # x [T, n, hn/2]
            return x * cos[p][:, None] + _rotate_half(x) * sin[p][:, None]

        for i in range(layers):
            p = f"transformer.layers.{i}."
            a = ln(h, p + "input_layernorm")
            mixed = lin(a, p + "attention.query_key_value").view(t, heads, 3 * hn)
            q, k, v = mixed.split(hn, dim=-1)  # [T, n, hn] each
            q1, q2 = q.chunk(2, dim=-1)
            k1, k2 = k.chunk(2, dim=-1)
            q = torch.cat([rope(q1, pos), rope(q2, block)], dim=-1)
            k = torch.cat([rope(k1, pos), rope(k2, block)], dim=-1)
            coeff = float(i + 1)
            scores = torch.einsum("qnd,knd->nqk", q / (math.sqrt(hn) * coeff), k)
            scores = scores.masked_fill(masked, -10000.0) * coeff
            probs = torch.softmax(scores, dim=-1)
            context = torch.einsum("nqk,knd->qnd", probs, v).reshape(t, heads * hn)
            h = a * alpha + lin(context, p + "attention.dense")
            m = ln(h, p + "post_attention_layernorm")
            h = m * alpha + lin(_gelu(lin(m, p + "mlp.dense_h_to_4h")), p + "mlp.dense_4h_to_h")
        h = ln(h, "transformer.final_layernorm")
        return SimpleNamespace(logits=F.linear(h, w["lm_head.weight"])[None])


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm_hf():
    return glm_model(kv_heads=2, seed=0)


@pytest.fixture(scope="module")
def glm_mha_hf():
    return glm_model(kv_heads=4, seed=1)


@pytest.fixture(scope="module")
def sources(glm_hf, glm_mha_hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chatglm_sources")
    hf_dict = glm_hf.config.to_dict()
    v1w = v1_weights(V1_CONFIG)
    return {
        "glm": parity.save_hf(glm_hf, root, "glm"),
        "thudm": write_source(
            root / "thudm", thudm_v2_weights(glm_hf, mqa=True), thudm_v2_config(hf_dict, True)
        ),
        "thudm_mha": write_source(
            root / "thudm_mha",
            thudm_v2_weights(glm_mha_hf, mqa=False),
            thudm_v2_config(glm_mha_hf.config.to_dict(), False),
        ),
        "v1": write_source(root / "v1", v1w, V1_CONFIG),
    }


@pytest.fixture(scope="module")
def references(glm_hf, glm_mha_hf) -> dict[str, torch.nn.Module]:
    v1 = ChatGLMv1Reference(v1_weights(V1_CONFIG), V1_CONFIG)
    return {"glm": glm_hf, "thudm": glm_hf, "thudm_mha": glm_mha_hf, "v1": v1}


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory):
    """(variant, tp, pp) -> converted checkpoint dir, converted once per module."""
    root = tmp_path_factory.mktemp("chatglm_ckpts")
    done: dict[tuple[str, int, int], Path] = {}

    def get(variant: str, tp: int = 1, pp: int = 1) -> Path:
        if (variant, tp, pp) not in done:
            out = root / f"{variant}_tp{tp}_pp{pp}"
            convert(sources[variant], out, ConvertOptions(tp_size=tp, pp_size=pp), show_progress=False)
            done[variant, tp, pp] = out
        return done[variant, tp, pp]

    return get


def prompt_of(variant: str) -> list[int]:
    return V1_PROMPT if variant == "v1" else V2_PROMPT


# --- parity ---------------------------------------------------------------------------------------


def rope_off(model) -> None:
    for layer in model.transformer.layers:
        layer.attention.rotary = None


def causal_mask(model) -> None:
    model.mask_kind = "causal"


def one_d_positions(model) -> None:
    """Block positions replaced by the positions: a 1D rotary over the whole head."""
    full = model.position_ids
    model.position_ids = lambda tokens, start, count: full(tokens, start, count)[:1].repeat(2, 1)


BROKEN = {
    "glm": [rope_off],
    "thudm": [rope_off],
    "thudm_mha": [rope_off],
    "v1": [rope_off, causal_mask, one_d_positions],
}


@pytest.mark.parametrize("variant", ["glm", "thudm", "thudm_mha", "v1"])
def test_logits_parity_prefill_and_decode(variant, checkpoints, references):
    """Prefill + 8 decode steps within 1e-4 * max(1, max|ref|); each broken variant misses by >= 100x."""
    ref, prompt = references[variant], prompt_of(variant)
    worst, scale = parity.prefill_and_decode_diffs(Engine.load(checkpoints(variant)), ref, prompt, steps=8)
    tol = parity.tolerance(torch.tensor(scale))
    print(f"\n{variant}: worst {worst:.3e}, tolerance {tol:.3e}, ratio {worst / tol:.4f}")
    assert worst <= tol, f"{variant}: max |diff| {worst:.3e} > {tol:.3e}"
    for breaker in BROKEN[variant]:
        engine = Engine.load(checkpoints(variant))
        breaker(engine.model)
        bad, _ = parity.prefill_and_decode_diffs(engine, ref, prompt, steps=8)
        print(f"{variant} broken by {breaker.__name__}: {bad:.3e} ({bad / tol:.0f}x tolerance)")
        assert bad >= 100 * tol, f"{variant}: {breaker.__name__} only misses by {bad:.3e} (< 100x {tol:.3e})"


def reference_greedy(ref, prompt: list[int], steps: int) -> tuple[list[int], int | None]:
    """Greedy tokens of the reference and the first step whose top-2 margin is < 1e-3 * max|logit|."""
    seq, tokens, close = list(prompt), [], None
    with torch.no_grad():
        for step in range(steps):
            logits = ref(torch.tensor([seq])).logits[0, -1].float()
            top = logits.topk(2).values
            if close is None and (top[0] - top[1]) < 1e-3 * logits.abs().max():
                close = step
            tokens.append(int(logits.argmax()))
            seq.append(tokens[-1])
    return tokens, close


@pytest.mark.parametrize("variant", ["thudm", "v1"])
def test_greedy_generation_matches_reference(variant, checkpoints, references):
    prompt = prompt_of(variant)
    expected, close = reference_greedy(references[variant], prompt, NEW_TOKENS)
    llm = LLM(checkpoints(variant))
    sampling = SamplingConfig(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = llm.generate([prompt], sampling)[0].output_ids
    upto = NEW_TOKENS if close is None else close
    print(f"\n{variant}: greedy {got}, reference {expected}, near-tie step {close}")
    assert got[:upto] == expected[:upto]
    assert len(got) == NEW_TOKENS


# --- tp / pp conversion ---------------------------------------------------------------------------


def reassemble(ckpt: Path) -> dict[str, torch.Tensor]:
    """The tp 1 / pp 1 tensors rebuilt from every rank file of `ckpt`."""
    data = read_json(ckpt / "config.json")
    config = validate_model_config(data, str(ckpt))
    spec = default_registry().get(config.architecture)
    m: Mapping = config.mapping
    parts: dict[str, list[tuple[torch.Tensor, int, object]]] = {}
    for rank in range(m.world_size):
        model = instantiate(spec, config, rank)
        tp_dims = {t.key: t.tp_dim for t in model_targets(model)}
        for key, tensor in load_rank_weights(ckpt, rank).items():
            name = key
            if key.startswith("transformer.layers."):
                local, rest = key[len("transformer.layers.") :].split(".", 1)
                name = f"transformer.layers.{int(local) + model.layer_offset}.{rest}"
            attention = model.transformer.layers[0].attention
            parts.setdefault(name, []).append((tensor, tp_dims[key], attention))
    whole = {}
    for name, pieces in parts.items():
        tensors = [p[0] for p in pieces]
        tp_dim = pieces[0][1]
        if tp_dim < 0:
            for t in tensors[1:]:
                assert torch.equal(t, tensors[0]), f"replicated {name} differs between ranks"
            whole[name] = tensors[0]
        elif ".attention.qkv." in name:
            att = pieces[0][2]
            d = att.head_dim
            split = [att.heads * d, att.kv_heads * d, att.kv_heads * d]
            q, k, v = zip(*(t.split(split) for t in tensors))
            whole[name] = torch.cat([*q, *k, *v])
        else:
            whole[name] = torch.cat(tensors, dim=tp_dim)
    return whole


TP_DIMS = DENSE_TP_DIMS  # fc / gate (gate_proj / up_proj halves of dense_h_to_4h) column-parallel


@pytest.mark.parametrize("variant", ["thudm", "glm", "v1"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_sharded_conversion_reassembles(variant, tp, pp, checkpoints):
    single = load_rank_weights(checkpoints(variant), 0)
    sharded = reassemble(checkpoints(variant, tp, pp))
    assert sorted(sharded) == sorted(single)
    assert_split_dims(checkpoints(variant, tp, pp), single, TP_DIMS, tp)
    for key, tensor in single.items():
        assert torch.equal(sharded[key], tensor), key


# --- strict loading ---------------------------------------------------------------------------------


def test_unused_source_key_fails_naming_it(sources, tmp_path):
    src = tmp_path / "extra"
    shutil.copytree(sources["thudm"], src)
    weights = load_file(str(src / "model.safetensors"))
    weights["transformer.encoder.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, str(src / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"transformer\.encoder\.layers\.0\.mlp\.extra_proj\.weight"):
        convert(src, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_source_key_fails_naming_it(sources, tmp_path):
    src = tmp_path / "missing"
    shutil.copytree(sources["v1"], src)
    weights = load_file(str(src / "model.safetensors"))
    del weights["transformer.layers.1.mlp.dense_4h_to_h.bias"]
    save_file(weights, str(src / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"transformer\.layers\.1\.mlp\.dense_4h_to_h\.bias"):
        convert(src, tmp_path / "out", show_progress=False)


# --- config and claims ---------------------------------------------------------------------------


def test_checkpoint_config_writes_every_field(checkpoints):
    for variant, cls in (("v1", ChatGLMConfig), ("thudm", ChatGLM2Config)):
        data = read_json(checkpoints(variant) / "config.json")
        assert set(data) == set(cls.model_fields), variant


def test_hf_defaults():
    """Absent fields take the defaults of the class that wrote the config."""
    mapping = Mapping()
    v1 = from_hf_config_v1({"position_encoding_2d": True}, "float16", mapping)
    assert (v1.vocab_size, v1.hidden_size, v1.num_hidden_layers, v1.intermediate_size) == (
        150528,
        4096,
        28,
        16384,
    )
    assert (v1.bos_token_id, v1.gmask_token_id, v1.max_position_embeddings) == (150004, 150001, 2048)
    v2 = from_hf_config_v2({"model_type": "chatglm", "multi_query_group_num": 2}, "float16", mapping)
    assert v2.num_key_value_heads == 32 and not v2.multi_query_attention  # multi_query_attention defaults off
    assert (v2.vocab_size, v2.head_size, v2.intermediate_size, v2.rotary_dim) == (65024, 128, 13696, 64)
    glm = from_hf_config_v2({"model_type": "glm"}, "bfloat16", mapping)
    assert (glm.num_key_value_heads, glm.head_size, glm.norm_epsilon, glm.qkv_bias) == (
        2,
        128,
        1.5625e-07,
        True,
    )
    with pytest.raises(ConfigError, match="quantization_bit"):
        from_hf_config_v2({"model_type": "chatglm", "quantization_bit": 4}, "float16", mapping)


CHATGLM_V1_HF = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "position_encoding_2d": True}
CHATGLM_V2_HF = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "multi_query_group_num": 2}


def test_claim_hook_picks_the_version():
    registry = default_registry()
    assert registry.for_hf_config(CHATGLM_V1_HF, "x").name == V1
    assert registry.for_hf_config(CHATGLM_V2_HF, "x").name == V2
    assert registry.for_hf_config({"architectures": ["GlmForCausalLM"], "model_type": "glm"}, "x").name == V2
    with pytest.raises(ConfigError, match="position_encoding_2d"):
        registry.for_hf_config({"architectures": ["ChatGLMModel"], "model_type": "chatglm"}, "x")
    assert registry.for_hf_config(CHATGLM_V1_HF, "x", override=V2).name == V2


class OtherGLMPlugin:
    """A third-party plugin that also claims THUDM chatglm configs."""

    @hookimpl
    def bestiary_claim_hf_config(self, hf_config: dict) -> str | None:
        return "OtherGLM" if hf_config.get("model_type") == "chatglm" else None


def test_two_claims_are_an_error_naming_both():
    registry = Registry.from_plugins({"fake": OtherGLMPlugin()})
    with pytest.raises(BestiaryError, match=r"'ChatGLMForCausalLM' and 'OtherGLM'"):
        registry.for_hf_config(CHATGLM_V1_HF, "config.json")
    assert registry.for_hf_config(CHATGLM_V1_HF, "config.json", override=V1).name == V1


def test_architecture_override_in_convert(sources, checkpoints, tmp_path):
    """--architecture picks the spec even where the claim hook refuses the config."""
    src = tmp_path / "ambiguous"
    shutil.copytree(sources["thudm_mha"], src)
    config = read_json(src / "config.json")
    del config["multi_query_group_num"]  # unused with multi_query_attention false, and the v2 marker
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="--architecture"):
        convert(src, tmp_path / "refused", show_progress=False)
    convert(src, tmp_path / "out", ConvertOptions(architecture=V2), show_progress=False)
    expected = load_rank_weights(checkpoints("thudm_mha"), 0)
    got = load_rank_weights(tmp_path / "out", 0)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_v1_perplexity_and_kv_calibration_use_its_2d_positions(sources, checkpoints, tmp_path):
    """eval and the calibration passes run v1 with its 2D position ids (they crashed on 1D ones)."""
    from kv_scales import expected_kv_scales

    from bestiary.core.format.config import QuantConfig
    from bestiary.core.runtime.evaluate import perplexity

    engine = Engine.load(checkpoints("v1"))
    ids = prompt_of("v1")
    logits = parity.EngineRunner(engine).feed(ids, all_logits=True)  # the executor's metadata
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert perplexity(engine, ids).nll == pytest.approx(float(nll), rel=1e-5)
    convert(sources["v1"], tmp_path / "kv", ConvertOptions(quantization=QuantConfig(kv_cache_quant_algo="INT8")),
            show_progress=False)
    # the scales are amax / 127 of the float engine's K and V over the calibration ids, per layer
    kv = load_file(str(tmp_path / "kv" / "rank0.safetensors"))
    for layer, expected in enumerate(expected_kv_scales(engine, 127.0)):
        scales = kv[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"]
        torch.testing.assert_close(scales, expected, rtol=1e-5, atol=0)
