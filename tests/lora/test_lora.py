"""LoRA adapters (HF PEFT) on every built-in architecture: logits equal PeftModel's, fp32.

Tiny random models; each adapter has seeded random A and B (B != 0), so every adapted module
moves the logits. Where PEFT cannot wrap a module (ChatGLM v1 / THUDM ChatGLM2 have no
transformers class, Mixtral's experts are fused parameters), the reference is the same
source with merged weights W + s B A.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import parity  # noqa: E402
from lora_helpers import peft_adapter, run_logits, write_adapter  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from bestiary.core.lora.adapter import load_adapter  # noqa: E402

PROMPT = [5, 17, 60, 3, 42, 8, 61, 27, 11, 70, 7, 33]
DECODE = [9, 44, 2, 30]
SMALL = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (HF model, PEFT LoraConfig fields)
CASES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2)),
        dict(r=8, lora_alpha=16, target_modules=LLAMA_TARGETS, rank_pattern={"q_proj": 4},
             alpha_pattern={"down_proj": 3.0})),
    "llama_rslora_regex": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=1)),
        dict(r=6, lora_alpha=12, use_rslora=True, target_modules=r".*\.(k_proj|v_proj|up_proj)")),
    # Mistral (through its window) and Qwen2 (q/k/v biases) declare LLaMA's PEFT table.
    "mistral_window": (lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, sliding_window=8)),
        dict(r=8, lora_alpha=16, target_modules=LLAMA_TARGETS)),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2)),
        dict(r=8, lora_alpha=16, target_modules=LLAMA_TARGETS)),
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        **SMALL, ffn_dim=96, num_hidden_layers=2, word_embed_proj_dim=64)),
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])),
    "falcon": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, new_decoder_architecture=False,
        multi_query=False, parallel_attn=True, bias=True, alibi=False)),
        dict(r=8, lora_alpha=8, target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"])),
    "falcon_new_decoder": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_kv_heads=2, num_hidden_layers=2,
        new_decoder_architecture=True, bias=False)),
        dict(r=4, lora_alpha=16, target_modules=["query_key_value", "dense_4h_to_h"])),
    "glm": (lambda: transformers.GlmForCausalLM(transformers.GlmConfig(
        **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, pad_token_id=0)),
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                 "down_proj"])),
    "mixtral_attention": (lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)),
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_peft(case, tmp_path):
    """Prefill and decode steps (the compiled CPU plan where the model has one) equal PeftModel."""
    make, config = CASES[case]
    torch.manual_seed(0)
    hf = parity.reinit_(make())
    engine = parity.convert_and_load(parity.save_hf(hf, tmp_path), tmp_path)
    ref_model = peft_adapter(hf, tmp_path / "adapter", **config)
    adapter = load_adapter(tmp_path / "adapter", engine.model)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT + DECODE])).logits[0].float()
        with ref_model.disable_adapter():
            base = ref_model(torch.tensor([PROMPT + DECODE])).logits[0].float()
    ours = run_logits(engine.model, adapter, PROMPT, DECODE)
    tol = parity.tolerance(ref)
    assert (ours - ref).abs().max().item() <= tol, (ours - ref).abs().max().item()
    assert (base - ref).abs().max().item() > 100 * tol, "the adapter must move the logits"


def test_the_compiled_plan_runs_adapted_decode_steps(tmp_path):
    """The LLaMA case's decode steps run on the compiled CPU plan (not the eager fallback)."""
    make, config = CASES["llama"]
    hf = parity.reinit_(make())
    engine = parity.convert_and_load(parity.save_hf(hf, tmp_path), tmp_path)
    peft_adapter(hf, tmp_path / "adapter", **config)
    adapter = load_adapter(tmp_path / "adapter", engine.model)
    from bestiary.core.kernels.cpu.build import library

    if library() is None:
        pytest.skip("compiled CPU kernels unavailable")
    run_logits(engine.model, adapter, PROMPT, DECODE[:1])
    plan = engine.model.__dict__.get("_decode_plans", {}).get(1)
    assert plan is not None, engine.model.decode_plan_status()
    assert engine.model.__dict__.get("plan_steps", 0) == 1 and not plan.points  # one compiled call
    bound = [plan.records[i].p[1] for i, _ in plan._lora_records]  # LoRA records: the adapter's rows
    assert len(bound) == 4 * 2 and all(bound)  # qkv, dense, fc + gate, proj of both layers


# --- merged-weight references ---------------------------------------------------------------


def _lora_pair(gen, out_f: int, in_f: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(r, in_f, generator=gen) / in_f**0.5, torch.randn(out_f, r, generator=gen) / r**0.5


def merged_case(weights: dict[str, torch.Tensor], modules: list[str], prefix: str, r: int, alpha: float, seed: int = 0):
    """(adapter tensors, merged weights): a rank-r adapter on each `<prefix>.<module>` weight of `weights`."""
    gen = torch.Generator().manual_seed(seed)
    tensors, merged = {}, dict(weights)
    for key, w in weights.items():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in modules or w.dim() != 2:
            continue
        a, b = _lora_pair(gen, w.shape[0], w.shape[1], r)
        tensors[f"{prefix}{module}.lora_A.weight"], tensors[f"{prefix}{module}.lora_B.weight"] = a, b
        merged[key] = w + (alpha / r) * b @ a
    return tensors, merged


def assert_adapter_equals_merged(base, merged, adapter_dir, prompt: list[int]) -> None:
    """The base engine with the adapter = the merged engine, and the adapter really moves the logits."""
    ours = run_logits(base.model, load_adapter(adapter_dir, base.model), prompt, DECODE)
    want = run_logits(merged.model, None, prompt, DECODE)
    plain = run_logits(base.model, None, prompt, DECODE)
    tol = parity.tolerance(want)
    assert (ours - want).abs().max().item() <= tol
    assert (plain - want).abs().max().item() > 100 * tol


def _chatglm_sources(variant: str):
    from test_chatglm import V1_CONFIG, glm_model, thudm_v2_config, thudm_v2_weights, v1_weights

    if variant == "v1":
        return v1_weights(V1_CONFIG), V1_CONFIG, V1_CONFIG["vocab_size"]
    glm = glm_model(2, seed=3)
    return thudm_v2_weights(glm, mqa=True), thudm_v2_config(glm.config.to_dict(), True), glm.config.vocab_size


@pytest.mark.parametrize("variant", ["v1", "thudm_v2"])
def test_chatglm_thudm_adapters_equal_merged_weights(variant, tmp_path):
    """THUDM query_key_value (per-head rows in v1) and ChatGLM2's fused dense_h_to_4h (gate / up halves)."""
    from test_chatglm import write_source

    weights, config, vocab = _chatglm_sources(variant)
    modules = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    tensors, merged = merged_case(weights, modules, "base_model.model.", r=4, alpha=8)
    base = parity.convert_and_load(write_source(tmp_path / "base", weights, config), tmp_path / "b")
    ref = parity.convert_and_load(write_source(tmp_path / "merged", merged, config), tmp_path / "m")
    adapter_dir = write_adapter(tmp_path / "adapter", tensors, r=4, lora_alpha=8, target_modules=modules)
    prompt = [p % vocab for p in PROMPT] if variant != "v1" else [3, 17, 45, 8, 60, 22, 31, 69, 70]
    assert_adapter_equals_merged(base, ref, adapter_dir, prompt)


def test_mixtral_expert_and_router_adapters_equal_merged_weights(tmp_path):
    """Per-expert w1 / w2 / w3 adapters (moe_h_to_4h, moe_4h_to_h, moe_gate) and the router (moe_router)."""
    make, _ = CASES["mixtral_attention"]
    hf_dir = parity.save_hf(parity.reinit_(make()), tmp_path)
    weights = load_file(str(hf_dir / "model.safetensors"))
    modules = ["w1", "w2", "w3", "gate"]
    tensors, merged = merged_case(weights, modules, "base_model.model.", r=4, alpha=4, seed=1)
    assert any(".experts.3.w2." in k for k in tensors) and any("block_sparse_moe.gate.lora_A" in k for k in tensors)
    merged_dir = tmp_path / "merged"
    merged_dir.mkdir()
    (merged_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file(merged, str(merged_dir / "model.safetensors"))
    base = parity.convert_and_load(hf_dir, tmp_path / "b")
    ref = parity.convert_and_load(merged_dir, tmp_path / "m")
    adapter_dir = write_adapter(tmp_path / "adapter", tensors, r=4, lora_alpha=4, target_modules=modules)
    assert_adapter_equals_merged(base, ref, adapter_dir, PROMPT)


@pytest.mark.parametrize("quant", [dict(quant_algo="W8A16"), dict(quant_algo="W4A16", group_size=32)])
def test_quantized_base_takes_adapters_in_the_activation_dtype(quant, tmp_path):
    """W8A16 / W4A16 qkv: y(adapter) - y(base) = s_q B_q A_q x on the q rows, s_k B_k A_k x on the k rows,
    computed from the adapter file; and the whole model runs with the adapter."""
    from bestiary.core.format.config import QuantConfig
    from bestiary.core.lora.batch import AdapterStack, StepLora

    make, config = CASES["llama"]
    hf = parity.reinit_(make())
    q = parity.convert_and_load(parity.save_hf(hf, tmp_path), tmp_path / "q", quantization=QuantConfig(**quant),
                                weight_quantizer="rtn")
    peft_adapter(hf, tmp_path / "adapter", **config)
    adapter = load_adapter(tmp_path / "adapter", q.model)
    assert all(p.a.dtype == p.b.dtype == q.model.dtype for ps in adapter.pieces.values() for p in ps)
    qkv = q.model.transformer.layers[0].attention.qkv
    assert qkv.quant is not None
    x = torch.randn(5, 64)
    lora = StepLora(AdapterStack([adapter], q.model.dtype, "cpu"), [2, 3], [0, -1])
    with torch.inference_mode():
        delta = qkv(x, lora) - qkv(x)
    t = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.0.self_attn."
    want = torch.zeros(5, delta.shape[1])
    for name, rows, scale in (("q_proj", slice(0, 64), 16 / 4), ("k_proj", slice(64, 96), 16 / 8),
                              ("v_proj", slice(96, 128), 16 / 8)):
        a, b = t[f"{pre}{name}.lora_A.weight"], t[f"{pre}{name}.lora_B.weight"]
        want[:2, rows] = scale * x[:2] @ a.t() @ b.t()
    assert (delta - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    logits = run_logits(q.model, adapter, PROMPT, DECODE)
    assert torch.isfinite(logits).all() and not torch.equal(logits, run_logits(q.model, None, PROMPT, DECODE))
