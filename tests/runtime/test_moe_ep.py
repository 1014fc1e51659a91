"""Expert parallelism for Mixtral-style MoE (mapping moe_tp_size / moe_ep_size, TensorRT-LLM's fields).

A rank holds E / moe_ep_size whole experts (ep_rank = tp_rank % moe_ep_size), each split along its FFN dim
over moe_tp_size ranks (moe_tp_rank = tp_rank // moe_ep_size); every rank routes every token with the
replicated router, runs its local experts, and the partial outputs are summed by the MoE's one all-reduce.
Tiny random fp32 HF Mixtrals (4 and 8 experts, top-1 and top-2) at ep 2 (tp 2, moe_tp 1) and tp 2 x ep 2
(tp 4, moe_tp 2, moe_ep 2) run like tp 1: logits within 1e-5 over a prefill and 12 teacher-forced decode
steps, greedy tokens equal up to tp 1's first near-tie.
"""

from __future__ import annotations

from pathlib import Path

import parity
import pytest
import torch
from cli_errors import one_line
from safetensors.torch import load_file

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.config import Mapping, PretrainedConfig, QuantConfig, read_json, validate_config
from bestiary.core.format.errors import ConfigError
from bestiary.core.layers.moe import MoE, route
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

transformers = pytest.importorskip("transformers")

STEPS = 12
LOGIT_TOL = 1e-5
PROMPT = [5, 17, 99, 3, 42, 8, 61, 27, 11, 120, 7, 33]
# For the weight-quantized engines (bf16 partial sums, differences ~1e-2): no tp 1 top-2 margin below 0.07
QUANT_PROMPT = [70, 58, 80, 75, 36, 79, 75, 55, 83, 118, 109, 52]
LAYOUTS = {"ep2": dict(tp_size=2, moe_ep_size=2), "tp2xep2": dict(tp_size=4, moe_tp_size=2, moe_ep_size=2)}


def hf_config(experts: int, top_k: int) -> dict:
    return dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=top_k,
                max_position_embeddings=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(experts, top_k, layout or "tp1", convert kwargs name) -> checkpoint dir, made on first use."""
    root = tmp_path_factory.mktemp("moe_ep")
    sources: dict[tuple, Path] = {}
    quant = {"": {}, "w4a16": dict(quantization=QuantConfig(quant_algo="W4A16", group_size=32),
                                   weight_quantizer="gptq", tune_steps=1),
             "w8a16": dict(quantization=QuantConfig(quant_algo="W8A16")),
             "int8kv": dict(quantization=QuantConfig(kv_cache_quant_algo="INT8"))}

    def get(experts: int, top_k: int, layout: str, mode: str = "") -> Path:
        if (experts, top_k) not in sources:
            torch.manual_seed(0)
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**hf_config(experts, top_k)))
            sources[experts, top_k] = parity.save_hf(parity.reinit_(model, seed=3), root, f"hf_e{experts}_k{top_k}")
        out = root / f"e{experts}_k{top_k}_{layout}_{mode or 'fp32'}"
        if not out.exists():
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("bestiary.core.convert.quantize_calibrated.RANDOM_CALIB_TOKENS", 128)
                convert(sources[experts, top_k], out, ConvertOptions(**LAYOUTS.get(layout, {}), **quant[mode]),
                        show_progress=False)
        return out

    get.source = lambda experts, top_k: sources[experts, top_k]
    return get


# --- the mapping fields --------------------------------------------------------------------


def test_mapping_moe_fields_default_derive_and_validate():
    assert (Mapping().moe_tp_size, Mapping().moe_ep_size) == (1, 1)
    assert (Mapping(tp_size=4).moe_tp_size, Mapping(tp_size=4).moe_ep_size) == (4, 1)  # plain TP
    assert Mapping(tp_size=4, moe_ep_size=2).moe_tp_size == 2
    assert Mapping(tp_size=4, moe_tp_size=1).moe_ep_size == 4
    m = Mapping(tp_size=4, pp_size=2, moe_ep_size=2)
    # TensorRT-LLM's placement: moe_tp_rank = tp_rank // moe_ep_size, moe_ep_rank = tp_rank % moe_ep_size
    assert [(m.moe_tp_rank(r), m.moe_ep_rank(r)) for r in range(8)] == [(0, 0), (0, 1), (1, 0), (1, 1)] * 2
    for bad in (dict(tp_size=4, moe_ep_size=3), dict(tp_size=4, moe_tp_size=2, moe_ep_size=1),
                dict(tp_size=2, moe_ep_size=4)):
        with pytest.raises(ConfigError, match=r"ckpt/config.json: field 'mapping': .*must equal tp_size") as err:
            validate_config(PretrainedConfig, {**MINIMAL, "mapping": bad}, "ckpt/config.json")
        assert "\n" not in str(err.value)


MINIMAL = dict(architecture="LlamaForCausalLM", dtype="float32", vocab_size=128, hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, hidden_act="silu")


def test_old_config_without_the_fields_loads_and_new_ones_round_trip():
    old = validate_config(PretrainedConfig, {**MINIMAL, "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}},
                          "old/config.json")
    assert old.mapping == Mapping(tp_size=2, moe_tp_size=2, moe_ep_size=1)
    written = PretrainedConfig(**MINIMAL, mapping=Mapping(tp_size=4, moe_ep_size=2)).to_json_dict()
    assert written["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "moe_tp_size": 2, "moe_ep_size": 2}
    assert validate_config(PretrainedConfig, written, "x").mapping == Mapping(tp_size=4, moe_ep_size=2)


# --- the layer: local experts' partial outputs sum to tp 1's ---------------------------------


def rank_moe(whole: MoE, tp: int, ep: int, rank: int) -> MoE:
    """Rank `rank`'s MoE at (tp, ep), its weights cut here by hand: experts (rank % ep) E/ep .., FFN part
    rank // ep of tp / ep."""
    e, moe_tp = whole.num_experts // ep, tp // ep
    ep_rank, moe_tp_rank = rank % ep, rank // ep
    hidden, inter = whole.fc.weight.shape[2], whole.fc.weight.shape[1]
    part = inter // moe_tp
    experts, rows = slice(ep_rank * e, (ep_rank + 1) * e), slice(moe_tp_rank * part, (moe_tp_rank + 1) * part)
    m = MoE(hidden, inter, whole.num_experts, whole.top_k, tp_rank=rank, tp_size=tp, ep_size=ep)
    m.router.weight.data = whole.router.weight.data.clone()
    m.fc.weight.data = whole.fc.weight.data[experts, rows].clone()
    m.gate.weight.data = whole.gate.weight.data[experts, rows].clone()
    m.proj.weight.data = whole.proj.weight.data[experts, :, rows].clone()
    return m


@pytest.mark.parametrize("experts, top_k", [(4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 2), (4, 4)])
def test_local_expert_partials_sum_to_tp1(experts, top_k, tp, ep):
    torch.manual_seed(experts * 10 + top_k)
    whole = MoE(32, 48, experts, top_k)
    for w in (whole.router.weight, whole.fc.weight, whole.gate.weight, whole.proj.weight):
        w.data = torch.randn_like(w) * 0.2
    x = torch.randn(9, 32)
    ref = whole.partial_forward(x)
    ranks = [rank_moe(whole, tp, ep, r) for r in range(tp)]
    assert all(m.fc.weight.shape == (experts // ep, 48 * ep // tp, 32) for m in ranks)
    total = sum(m.partial_forward(x) for m in ranks)
    torch.testing.assert_close(total, ref, rtol=0, atol=1e-5)
    # the Triton path's local routing (N top-1 rows of local ids), here through the torch reference
    weights, chosen = route(whole.router(x), top_k)
    fused = sum(m._fused_local(x, weights, chosen) for m in ranks)
    torch.testing.assert_close(fused, ref, rtol=0, atol=1e-5)


# --- conversion: each rank file holds only its experts -------------------------------------

# Hard-coded placement of 8 experts, intermediate 96: rank -> (experts, FFN rows of each expert).
EXPECTED_E8 = {
    "ep2": {0: (range(0, 4), slice(0, 96)), 1: (range(4, 8), slice(0, 96))},
    "tp2xep2": {0: (range(0, 4), slice(0, 48)), 1: (range(4, 8), slice(0, 48)),
                2: (range(0, 4), slice(48, 96)), 3: (range(4, 8), slice(48, 96))},
}


@pytest.mark.parametrize("layout", list(EXPECTED_E8))
def test_rank_files_hold_only_their_experts(layout, checkpoints):
    ckpt, tp1 = checkpoints(8, 2, layout), checkpoints(8, 2, "tp1")
    hf = load_file(str(checkpoints.source(8, 2) / "model.safetensors"))
    mapping = read_json(ckpt / "config.json")["mapping"]
    tp = LAYOUTS[layout]["tp_size"]
    assert mapping == {"world_size": tp, "tp_size": tp, "pp_size": 1, "moe_tp_size": tp // 2, "moe_ep_size": 2}
    tp1_keys = set(load_rank_weights(tp1, 0))
    for rank, (experts, rows) in EXPECTED_E8[layout].items():
        weights = load_rank_weights(ckpt, rank)
        assert set(weights) == tp1_keys  # no per-expert or extra tensors
        for layer in range(2):
            hf_moe, ours = f"model.layers.{layer}.block_sparse_moe", f"transformer.layers.{layer}.mlp"
            for name, hf_name, cut in (("fc", "w1", lambda t, r=rows: t[r]), ("gate", "w3", lambda t, r=rows: t[r]),
                                       ("proj", "w2", lambda t, r=rows: t[:, r])):
                want = torch.stack([cut(hf[f"{hf_moe}.experts.{e}.{hf_name}.weight"]) for e in experts])
                assert torch.equal(weights[f"{ours}.{name}.weight"], want), (rank, layer, name)
            assert torch.equal(weights[f"{ours}.router.weight"], hf[f"{hf_moe}.gate.weight"])  # replicated
        qkv = weights["transformer.layers.0.attention.qkv.weight"]  # attention stays TP over tp_size:
        assert qkv.shape[0] == {2: (2 + 1 + 1) * 16, 4: (1 + 1 + 1) * 16}[tp]  # q, k, v heads of 16 per rank


@pytest.mark.parametrize("layout", list(EXPECTED_E8))
def test_stacked_expert_source_is_cut_by_expert_group(layout, checkpoints, tmp_path):
    """A source holding each layer's experts stacked [E, ...] (one tensor, not E) is cut along dim 0: the
    same rank files as from the per-expert source."""
    from safetensors.torch import save_file

    checkpoints(8, 2, layout)
    src = checkpoints.source(8, 2)
    hf = load_file(str(src / "model.safetensors"))
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((src / "config.json").read_text())
    for layer in range(2):
        moe = f"model.layers.{layer}.block_sparse_moe"
        for name in ("w1", "w2", "w3"):
            hf[f"{moe}.stacked_{name}.weight"] = torch.stack([hf.pop(f"{moe}.experts.{e}.{name}.weight")
                                                              for e in range(8)])
    save_file(hf, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    keys = {"fc": "stacked_w1", "gate": "stacked_w3", "proj": "stacked_w2"}
    out = convert(stacked, tmp_path / "out", ConvertOptions(**LAYOUTS[layout], customized_key_dict=keys),
                  show_progress=False)
    for rank in EXPECTED_E8[layout]:
        ours, want = load_rank_weights(out, rank), load_rank_weights(checkpoints(8, 2, layout), rank)
        assert set(ours) == set(want) and all(torch.equal(ours[k], want[k]) for k in want), rank


def test_calibrated_int4_ranks_are_cut_from_tp1_by_expert(checkpoints):
    """GPTQ W4A16 quantizes the whole model once and cuts each rank from it (write_sharded_rank): under EP
    the experts (float) are cut by expert group, the quantized attention / router by tp."""
    tp1 = load_rank_weights(checkpoints(4, 2, "tp1", "w4a16"), 0)
    ckpt = checkpoints(4, 2, "ep2", "w4a16")
    for rank, experts in ((0, slice(0, 2)), (1, slice(2, 4))):
        weights = load_rank_weights(ckpt, rank)
        for name in ("fc", "gate", "proj"):
            key = f"transformer.layers.1.mlp.{name}.weight"
            assert torch.equal(weights[key], tp1[key][experts]), (rank, name)
        router = "transformer.layers.1.mlp.router.weight"
        assert torch.equal(weights[router], tp1[router]) and weights[router].dtype != torch.float32  # packed
    assert_runs_like_tp1(checkpoints(4, 2, "tp1", "w4a16"), ckpt, rel_tol=1e-2, prompt=QUANT_PROMPT)


# --- engines: ep ranks run like tp 1 --------------------------------------------------------


def teacher_forced(engine, prompt: list[int], tokens: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """(logits [1 + STEPS, V]: the prefill's last token, then each decode step; greedy tokens): decode feeds
    `tokens` when given, else the engine's own argmax."""
    runner = parity.EngineRunner(engine)
    rows, chosen = [runner.feed(prompt)[0]], []
    for i in range(STEPS):
        chosen.append(tokens[i] if tokens is not None else int(rows[-1].argmax()))
        rows.append(runner.feed([chosen[-1]])[0])
    return torch.stack(rows), chosen


def first_close_call(logits: torch.Tensor, diff: float) -> int:
    """Index of the first row whose top-2 margin is below 2 * `diff` (a logit difference of `diff` could
    swap its argmax), len(logits) when none."""
    margins = logits.topk(2, dim=-1).values  # [rows, 2]
    close = ((margins[:, 0] - margins[:, 1]) < 2 * diff).nonzero()
    return int(close[0]) if len(close) else len(logits)


def assert_runs_like_tp1(tp1_dir: Path, ep_dir: Path, rel_tol: float | None = None, prompt=PROMPT) -> None:
    """Teacher-forced logits within LOGIT_TOL (or rel_tol * max|logit|) of tp 1's; greedy generation
    equals tp 1's tokens up to tp 1's first step whose top-2 margin the measured difference could bridge
    (all STEPS + 1 when there is none)."""
    ref, tokens = teacher_forced(Engine.load(tp1_dir), prompt)
    llm = LLM(ep_dir, num_threads=1)
    try:
        model = llm.engine.model
        assert model.config.mapping.moe_ep_size == 2
        ours, _ = teacher_forced(llm.engine, prompt, tokens)
        worst = (ours - ref).abs().max().item()
        tol = LOGIT_TOL if rel_tol is None else rel_tol * ref.abs().max().item()
        assert worst <= tol, f"max |ep - tp1| = {worst:.3g}"
        agree = first_close_call(ref, max(worst, LOGIT_TOL))
        assert agree >= STEPS // 2, f"tp 1 has a near-tie at step {agree}; pick another prompt"
        (out,) = llm.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
        assert out.output_ids[:agree] == tokens[:agree]
    finally:
        llm.close()


FAST = [("ep2", 4, 1), ("ep2", 8, 2), ("tp2xep2", 4, 2)]
SLOW = [("ep2", 4, 2), ("ep2", 8, 1), ("tp2xep2", 4, 1), ("tp2xep2", 8, 1), ("tp2xep2", 8, 2)]


@pytest.mark.parametrize("layout, experts, top_k", FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_ep_engine_equals_tp1(layout, experts, top_k, checkpoints):
    assert_runs_like_tp1(checkpoints(experts, top_k, "tp1"), checkpoints(experts, top_k, layout))


def test_int8_kv_cache_under_ep(checkpoints):
    """INT8 KV scales are calibrated once on the whole model and copied to every rank: fp32 parity holds."""
    ckpt = checkpoints(4, 2, "ep2", "int8kv")
    scale = "transformer.layers.0.attention.kv_cache_scaling_factor"
    tp1 = load_rank_weights(checkpoints(4, 2, "tp1", "int8kv"), 0)[scale]
    assert all(torch.equal(load_rank_weights(ckpt, r)[scale], tp1) for r in (0, 1))
    assert_runs_like_tp1(checkpoints(4, 2, "tp1", "int8kv"), ckpt)


def test_w8a16_under_ep(checkpoints):
    """W8A16 multiplies in bf16 on the CPU: the row-parallel attention output's two partial sums round
    differently from one (the 1e-2 relative bound test_tp_runtime uses); the experts stay float."""
    assert_runs_like_tp1(checkpoints(4, 2, "tp1", "w8a16"), checkpoints(4, 2, "ep2", "w8a16"), rel_tol=1e-2,
                         prompt=QUANT_PROMPT)


def test_qwen2_moe_shared_expert_under_ep(tmp_path):
    """Qwen2-MoE: routed experts spread over ep 2, the shared expert (and its gate) TP-split over both ranks."""
    config = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=256)
    torch.manual_seed(0)
    src = parity.save_hf(parity.reinit_(transformers.Qwen2MoeForCausalLM(config), seed=3), tmp_path, "hf")
    tp1 = convert(src, tmp_path / "tp1", show_progress=False)
    ep2 = convert(src, tmp_path / "ep2", ConvertOptions(tp_size=2, moe_ep_size=2), show_progress=False)
    whole = load_rank_weights(tp1, 0)
    for rank in (0, 1):
        weights = load_rank_weights(ep2, rank)
        fc = "transformer.layers.0.mlp.fc.weight"
        assert torch.equal(weights[fc], whole[fc][2 * rank:2 * rank + 2])  # experts 0-1 | 2-3, whole FFN
        shared = "transformer.layers.0.mlp.shared_expert.proj.weight"
        assert torch.equal(weights[shared], whole[shared][:, 24 * rank:24 * rank + 24])  # TP over both ranks
    assert_runs_like_tp1(tp1, ep2)


# --- refusals ---------------------------------------------------------------------------------


def test_expert_lora_is_refused_under_ep(checkpoints, tmp_path):
    """LoRA on the experts is not placed by expert group: loading such an adapter on an ep rank is one line."""
    from lora_helpers import write_adapter

    from bestiary.core.format.errors import BestiaryError
    from bestiary.core.lora.adapter import load_adapter
    from bestiary.core.runtime.engine import validate_model_config
    from bestiary.models.mixtral.model import MixtralForCausalLM

    config = validate_model_config(read_json(checkpoints(4, 2, "ep2") / "config.json"), "config.json")
    model = MixtralForCausalLM(config, 1, device="cpu")
    pre = "base_model.model.model.layers.0.block_sparse_moe.experts.3.w1"
    adapter = write_adapter(tmp_path / "adapter", {f"{pre}.lora_A.weight": torch.zeros(4, 64),
                                                   f"{pre}.lora_B.weight": torch.zeros(96, 4)},
                            r=4, lora_alpha=4, target_modules=["w1"])
    with pytest.raises(BestiaryError, match=r"LoRA on MoE experts is not supported with expert parallelism"):
        load_adapter(adapter, model)


def test_bad_expert_flags_are_one_line(capsys, checkpoints, tmp_path):
    from tiny_llama import make_tiny_llama

    checkpoints(4, 2, "tp1")
    src, llama = str(checkpoints.source(4, 2)), str(make_tiny_llama(tmp_path / "llama"))
    capsys.readouterr()  # the sources' save messages
    out = str(tmp_path / "out")
    one_line(capsys, ["convert", "--model_dir", src, "--output_dir", out, "--tp_size", "4", "--moe_ep_size", "3"],
             2, "--moe_ep_size 3", "must equal --tp_size 4")
    one_line(capsys, ["convert", "--model_dir", src, "--output_dir", out, "--tp_size", "2", "--moe_tp_size", "2",
                      "--moe_ep_size", "2"], 2, "--moe_tp_size 2 --moe_ep_size 2", "must equal --tp_size 2")
    one_line(capsys, ["convert", "--model_dir", src, "--output_dir", out, "--tp_size", "8", "--moe_ep_size", "8"],
             2, "--moe_ep_size 8", "num_local_experts 4 is not divisible")
    one_line(capsys, ["convert", "--model_dir", llama, "--output_dir", out, "--tp_size", "2", "--moe_ep_size", "2"],
             2, "--moe_ep_size 2", "LlamaForCausalLM has no experts")
    one_line(capsys, ["convert", "--model_dir", llama, "--dry_run", "--tp_size", "2", "--moe_ep_size", "2"],
             2, "LlamaForCausalLM has no experts")
    assert not Path(out).exists()
