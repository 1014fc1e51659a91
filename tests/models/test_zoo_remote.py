"""The conformance kit on the remote-code families (no transformers class): Baichuan / Baichuan2 and Qwen-1.

Each reference is the family's forward transcribed into plain torch from its upstream modeling file
(cited per function), run on the tiny random weights it saves under the HF names and config.json
fields of the published checkpoints; it never calls bestiary.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from bestiary.testing import FunctionReference, conformance

W = dict[str, torch.Tensor]


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> W:
    """Seeded weights: norms ~1 + 0.1 N(0, 1), biases 0.1 N, matrices N(0, 1) / sqrt(fan_in), embeddings N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g)
        if "norm" in name or "ln_f" in name or name.endswith(("ln_1.weight", "ln_2.weight")):
            x = 1 + 0.1 * x
        elif len(shape) == 1:
            x = 0.1 * x
        elif "wte" not in name and "embed_tokens" not in name:
            x = x / math.sqrt(shape[1])
        out[name] = x
    return out


def save_source(directory: Path, config: dict, weights: W) -> W:
    """config.json + model.safetensors, the layout of a published HF checkpoint."""
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return weights


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of both upstream files: x * rsqrt(mean(x^2) + eps) * w."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) of the two halves (both files' rotate_half / _rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, rot_dim: int, base: float) -> torch.Tensor:
    """x [T, H, D]: the first rot_dim dims rotated, t_ * cos + rotate_half(t_) * sin, emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(x.shape[0]).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, rot]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((rot * emb.cos() + rotate_half(rot) * emb.sin(), rest), dim=-1)


# --- Baichuan / Baichuan2 ------------------------------------------------------------------------
# Upstream: baichuan-inc/Baichuan2-13B-Chat modeling_baichuan.py, read from its mirror
# jrd77/Baichuan2-13B-Chat:modeling_baichuan.py (_get_interleave, _gen_alibi_mask, BaichuanAttention,
# BaichuanLayer, NormHead); the 7B's RoPE is baichuan-inc/Baichuan2-7B-Base modeling_baichuan.py's
# RotaryEmbedding + rotate_half (LLaMA's form), the rest of its forward as the 13B's without ALiBi.


def get_interleave(n: int) -> list[float]:
    """_get_interleave: the ALiBi slopes of n heads."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + get_interleave(2 * closest)[0::2][: n - closest]


def gen_alibi_mask(n_head: int, max_pos: int) -> torch.Tensor:
    """_gen_alibi_mask: triu(-inf, 1) + slopes * (j - (max_pos - 1)) + (max_pos - 1): [n_head, max_pos, max_pos]."""
    slopes = torch.tensor(get_interleave(n_head))
    position_point = torch.arange(max_pos) - max_pos + 1
    position_point = position_point.unsqueeze(0).unsqueeze(0).expand(n_head, -1, -1)
    diag = torch.diag(position_point[0])
    position_point = position_point - diag.unsqueeze(0).unsqueeze(0).transpose(-1, -2)
    alibi = (slopes.unsqueeze(1).unsqueeze(1) * position_point).view(n_head, 1, max_pos)
    return torch.triu(torch.full((max_pos, max_pos), float("-inf")), 1).unsqueeze(0) + alibi


def baichuan_forward(cfg: dict, w: W, ids: list[int]) -> torch.Tensor:
    """BaichuanForCausalLM.forward without cache: logits [T, V]."""
    hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    d, t = hidden // heads, len(ids)
    alibi = "max_position_embeddings" not in cfg
    if alibi:
        mask = gen_alibi_mask(heads, cfg["model_max_length"])[:, :t, :t]  # [H, T, T]
    else:
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        proj = F.linear(h, w[p + "self_attn.W_pack.weight"]).unflatten(-1, (3, hidden))  # [T, 3, hidden]
        q, k, v = (proj[:, j].view(t, heads, d) for j in range(3))
        if not alibi:
            q, k = rope(q, d, 10000.0), rope(k, d, 10000.0)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d) + mask
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, hidden)
        x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(mlp, w[p + "mlp.down_proj.weight"])
    head = w["lm_head.weight"]
    if cfg["vocab_size"] == 125696 or cfg.get("norm_head"):  # Baichuan2's NormHead
        head = F.normalize(head)
    return F.linear(rms_norm(x, w["model.norm.weight"], eps), head)


def baichuan_source(cfg: dict, directory: Path) -> W:
    hidden, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (v, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.W_pack.weight": (3 * hidden, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    weights = random_weights(shapes, seed=1)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0  # rows far from unit norm: NormHead matters
    return save_source(directory, cfg, weights)


def baichuan(cfg: dict) -> FunctionReference:
    return FunctionReference(partial(baichuan_source, cfg), partial(baichuan_forward, cfg))


BAICHUAN = dict(architectures=["BaichuanForCausalLM"], model_type="baichuan", hidden_size=64, intermediate_size=80,
                num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-6, hidden_act="silu",
                tie_word_embeddings=False)
# Baichuan2-7B's config has max_position_embeddings (RoPE); 13B's only model_max_length (ALiBi). NormHead is
# Baichuan2's 125,696-token vocabulary (test_baichuan_position_scheme_and_norm_head_from_published_fields); here
# a 96-token vocabulary with `norm_head` set keeps the case fast. 6 heads: non-power-of-two ALiBi slopes.
# baichuan2_13b_alibi_normhead: Baichuan2-13B, ALiBi and NormHead together; 10 heads, non-power-of-two like
# its 40 (8 power-of-two slopes + 2 interleaved), and even, so the tp 2 run (test_zoo_tp) splits them.
BAICHUAN_CASES = {
    "baichuan2_7b_rope": baichuan(BAICHUAN | dict(vocab_size=96, norm_head=True, max_position_embeddings=128,
                                                  model_max_length=128)),
    "13b_alibi": baichuan(BAICHUAN | dict(vocab_size=96, hidden_size=48, num_attention_heads=6,
                                          model_max_length=128)),
    "baichuan2_13b_alibi_normhead": baichuan(BAICHUAN | dict(vocab_size=96, norm_head=True, hidden_size=160,
                                                             num_attention_heads=10, model_max_length=128)),
}
TestBaichuan = conformance("BaichuanForCausalLM", BAICHUAN_CASES)


# --- Qwen-1 ----------------------------------------------------------------------------------------
# Upstream: Qwen/Qwen-7B-Chat modeling_qwen.py, read from its mirror undefdev/Qwen-7B-Chat:modeling_qwen.py
# (QWenAttention.forward and _attn, QWenMLP, QWenBlock, RotaryEmbedding, apply_rotary_pos_emb, RMSNorm).


def qwen_forward(cfg: dict, w: W, ids: list[int]) -> torch.Tensor:
    """QWenLMHeadModel.forward without cache (fp32, no flash attention): logits [T, V]."""
    hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_epsilon"]
    d, t, seq_length = hidden // heads, len(ids), cfg["seq_length"]
    rot_dim = int(d * cfg["rotary_pct"]) if cfg["rotary_pct"] != 1.0 else d
    logn = torch.tensor([math.log(i, seq_length) if i > seq_length else 1 for i in range(1, t + 1)])[:, None, None]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    x = w["transformer.wte.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        h = rms_norm(x, w[p + "ln_1.weight"], eps)
        q, k, v = (z.view(t, heads, d) for z in linear(h, p + "attn.c_attn").split(hidden, dim=-1))
        q, k = rope(q, rot_dim, cfg["rotary_emb_base"]), rope(k, rot_dim, cfg["rotary_emb_base"])
        if cfg["use_logn_attn"]:
            q = q * logn
        scores = torch.einsum("thd,shd->hts", q, k) / torch.full([], d**0.5)
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, hidden)
        x = x + linear(attn, p + "attn.c_proj")
        h = rms_norm(x, w[p + "ln_2.weight"], eps)
        x = x + linear(linear(h, p + "mlp.w1") * F.silu(linear(h, p + "mlp.w2")), p + "mlp.c_proj")
    return F.linear(rms_norm(x, w["transformer.ln_f.weight"], eps), w["lm_head.weight"])


def qwen_source(cfg: dict, directory: Path) -> W:
    hidden, ff, v, bias = cfg["hidden_size"], cfg["intermediate_size"] // 2, cfg["vocab_size"], not cfg["no_bias"]
    shapes = {"transformer.wte.weight": (v, hidden), "transformer.ln_f.weight": (hidden,), "lm_head.weight": (v, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        linears = {"attn.c_attn": (3 * hidden, hidden), "attn.c_proj": (hidden, hidden), "mlp.w1": (ff, hidden),
                   "mlp.w2": (ff, hidden), "mlp.c_proj": (hidden, ff)}
        shapes |= {p + "ln_1.weight": (hidden,), p + "ln_2.weight": (hidden,)}
        shapes |= {p + name + ".weight": shape for name, shape in linears.items()}
        shapes |= {p + name + ".bias": shape[:1] for name, shape in linears.items() if bias or name == "attn.c_attn"}
    return save_source(directory, cfg, random_weights(shapes, seed=2))


def qwen(cfg: dict) -> FunctionReference:
    return FunctionReference(partial(qwen_source, cfg), partial(qwen_forward, cfg))


# Qwen-7B's config.json fields (intermediate_size is twice w1's width; no_bias: c_attn alone has a bias).
QWEN = dict(architectures=["QWenLMHeadModel"], model_type="qwen", vocab_size=96, hidden_size=64, intermediate_size=160,
            num_hidden_layers=2, num_attention_heads=4, kv_channels=16, layer_norm_epsilon=1e-6,
            max_position_embeddings=128, seq_length=128, rotary_emb_base=10000, rotary_pct=1.0, no_bias=True,
            use_dynamic_ntk=True, use_logn_attn=True, scale_attn_weights=True, tie_word_embeddings=False)
# logn: without dynamic NTK the engine runs past seq_length 8, so the 12-token prompt is scaled from position 8 on.
QWEN_CASES = {
    "qwen_7b": qwen(QWEN),
    "logn_partial_rotary_biases": qwen(QWEN | dict(seq_length=8, use_dynamic_ntk=False, rotary_pct=0.5,
                                                   no_bias=False)),
}
TestQwen = conformance("QWenLMHeadModel", QWEN_CASES)

# architecture -> its cases, for benchmarks/zoo_parity.py (the closing parity table).
ZOO = {"BaichuanForCausalLM": BAICHUAN_CASES, "QWenLMHeadModel": QWEN_CASES}


def test_qwen_dynamic_ntk_caps_at_seq_length():
    from bestiary.core.format.config import Mapping
    from bestiary.models.qwen.model import from_hf_config

    assert from_hf_config(QWEN | dict(seq_length=32), "float32", Mapping()).max_position_embeddings == 32
    no_ntk = from_hf_config(QWEN | dict(seq_length=32, use_dynamic_ntk=False), "float32", Mapping())
    assert no_ntk.max_position_embeddings == 128 and no_ntk.intermediate_size == 80


def test_baichuan_position_scheme_and_norm_head_from_published_fields():
    from bestiary.core.format.config import Mapping
    from bestiary.models.baichuan.model import from_hf_config

    b7 = from_hf_config(BAICHUAN | dict(vocab_size=125696, max_position_embeddings=4096), "float32", Mapping())
    b13 = from_hf_config(BAICHUAN | dict(vocab_size=64000, model_max_length=4096), "float32", Mapping())
    b2_13 = from_hf_config(BAICHUAN | dict(vocab_size=125696, model_max_length=4096), "float32", Mapping())
    assert (b7.position_embedding_type, b7.norm_head) == ("rope_gpt_neox", True)
    assert (b13.position_embedding_type, b13.norm_head, b13.max_position_embeddings) == ("alibi", False, 4096)
    assert (b2_13.position_embedding_type, b2_13.norm_head) == ("alibi", True)  # Baichuan2-13B: both
