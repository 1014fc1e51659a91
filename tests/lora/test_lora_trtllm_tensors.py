"""TensorRT-LLM's LoRA tensors (LoraWeights / LoraConfig): the worked example of its LoRA docs, the
converters PEFT dir <-> TensorRT-LLM LoRA tensors, `bestiary convert --lora_dir`, and rows that are refused."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import parity  # noqa: E402
from lora_helpers import peft_adapter, run_logits, tiny_llama  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.lora import trtllm_tensors  # noqa: E402
from bestiary.core.lora.adapter import load_adapter, module_dims  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.lora.trtllm_convert import peft_to_trtllm, trtllm_to_peft, write_peft  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.registry import default_registry  # noqa: E402

# TensorRT-LLM's example: tp 1, pp 1, 4 layers, hidden 4 (2 heads of 2: q, k and v are 4 rows each).
EXAMPLE = dict(vocab_size=32, hidden_size=4, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=64)
EXAMPLE_CONFIG = [[1, 0, 2], [2, 0, 4], [1, 1, 2], [2, 1, 4], [1, 2, 2], [1, 3, 8]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_seed_example")
    convert(parity.save_hf(tiny_llama(0, **EXAMPLE), root), root / "ckpt", ConvertOptions(dtype="float32"),
            show_progress=False)
    return root / "ckpt"


def _example_weights() -> np.ndarray:
    """Row j holds 100 j + i at position i (64 = the widest row, layer 3's rank-8 q: 8*4 + 4*8)."""
    return np.array([[100 * j + i for i in range(64)] for j in range(6)], dtype=np.float16)


def test_worked_example_rows_unpack_to_the_hand_written_matrices(example):
    model = Engine.load(example).model
    source = trtllm_tensors.read_rows(_example_weights(), np.array(EXAMPLE_CONFIG, dtype=np.int32),
                                    lambda m, i: module_dims(model, m, i))
    got = [(m.modules, m.layer, m.rank) for m in source.modules]
    assert got == [(("attn_q",), 0, 2), (("attn_k",), 0, 4), (("attn_q",), 1, 2), (("attn_k",), 1, 4),
                   (("attn_q",), 2, 2), (("attn_q",), 3, 8)]
    q0, k0, q3 = source.modules[0], source.modules[1], source.modules[5]
    # q, layer 0: <2 x 4 in weights>, <4 x 2 out weights>, then 48 values of padding
    assert q0.a.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert q0.b.tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    # k, layer 0: <4 x 4 in weights>, <4 x 4 out weights>, then 32 values of padding
    assert k0.a.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110, 111], [112, 113, 114, 115]]
    assert k0.b.tolist() == [[116, 117, 118, 119], [120, 121, 122, 123], [124, 125, 126, 127], [128, 129, 130, 131]]
    # q, layer 3, rank 8: <8 x 4 in weights>, <4 x 8 out weights>, no padding
    assert q3.a.tolist() == [[500, 501, 502, 503], [504, 505, 506, 507], [508, 509, 510, 511], [512, 513, 514, 515],
                             [516, 517, 518, 519], [520, 521, 522, 523], [524, 525, 526, 527], [528, 529, 530, 531]]
    assert q3.b.tolist() == [[532, 533, 534, 535, 536, 537, 538, 539], [540, 541, 542, 543, 544, 545, 546, 547],
                             [548, 549, 550, 551, 552, 553, 554, 555], [556, 557, 558, 559, 560, 561, 562, 563]]
    assert all(m.scaling == 1.0 for m in source.modules)


def test_worked_example_through_a_request_lands_on_the_qkv_rows(example):
    """LoraRequest(task_id, weights=, config=): q's B on rows 0-3 of the fused [q; k; v], k's on rows 4-7."""
    llm = LLM(example)
    adapter = llm.lora_store.get(LoraRequest(7, weights=_example_weights(), config=np.array(EXAMPLE_CONFIG)))
    assert adapter.name == "7"
    assert sorted(adapter.pieces) == [(f"transformer.layers.{i}.attention.qkv", -1) for i in range(4)]
    q, k = adapter.pieces[("transformer.layers.0.attention.qkv", -1)]
    assert (q.module, k.module) == ("attn_q", "attn_k")
    assert q.b.tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]] + [[0, 0]] * 8
    assert k.b.tolist() == [[0, 0, 0, 0]] * 4 + [[116, 117, 118, 119], [120, 121, 122, 123], [124, 125, 126, 127],
                                                 [128, 129, 130, 131]] + [[0, 0, 0, 0]] * 4
    assert k.a.tolist()[3] == [112, 113, 114, 115]
    assert [p.module for p in adapter.pieces[("transformer.layers.3.attention.qkv", -1)]] == ["attn_q"]
    # later requests bring the id alone; torch tensors are taken as numpy arrays are
    assert llm.lora_store.get(LoraRequest(7)) is adapter
    again = llm.lora_store.get(LoraRequest("8", weights=torch.from_numpy(_example_weights()),
                                           config=torch.tensor(EXAMPLE_CONFIG)))
    assert torch.equal(again.pieces[("transformer.layers.3.attention.qkv", -1)][0].a, q.a.new_tensor(
        [[500 + 4 * r + c for c in range(4)] for r in range(8)]))


@pytest.mark.parametrize(("config", "message"), [
    ([[2, 0, 4], [1, 1, 2]], "weights row has 16"),  # rank 4 k needs 4*4 + 4*4 = 32 values
    ([[1, 0, 2], [1, 0, 2]], "given twice"),
    ([[18, 0, 2], [1, 1, 2]], "unknown module id 18"),
    ([[1, 4, 2], [1, 1, 2]], "layer 4, but the base model has 4 layers"),
    ([[13, 0, 2], [1, 1, 2]], "names no expert"),
    ([[1, 0, 2, 1], [1, 1, 2, 0]], "DoRA"),
])
def test_bad_rows_name_the_row(example, config, message):
    model = Engine.load(example).model
    weights = np.zeros((2, 16), dtype=np.float32)
    with pytest.raises(BestiaryError, match=message) as err:
        trtllm_tensors.read_rows(weights, np.array(config), lambda m, i: module_dims(model, m, i))
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny LLaMA checkpoint and a PEFT adapter with rank_pattern / alpha_pattern and rslora."""
    root = tmp_path_factory.mktemp("lora_seed_tiny")
    hf = tiny_llama(0)
    convert(parity.save_hf(hf, root), root / "ckpt", ConvertOptions(dtype="float32"), show_progress=False)
    peft_model = peft_adapter(tiny_llama(0), root / "peft", seed=3, b_scale=2.0, r=8, lora_alpha=12,
                              use_rslora=True, target_modules=TARGETS, rank_pattern={"v_proj": 4},
                              alpha_pattern={"down_proj": 5})
    return root, peft_model


def test_peft_to_seed_to_request_equals_peft_request(tiny):
    root, _ = tiny
    model = Engine.load(root / "ckpt").model
    registry = default_registry()
    weights, config = peft_to_trtllm(root / "peft", registry.get("LlamaForCausalLM"), registry, torch.float32)
    assert weights.shape[0] == 2 * len(TARGETS) and config[:, 0].tolist()[:7] == [1, 2, 3, 4, 5, 6, 7]
    assert sorted(set(config[:, 2].tolist())) == [4, 8]
    llm = LLM(root / "ckpt")
    from_seed = llm.lora_store.get(LoraRequest("seed", weights=weights.numpy(), config=config.numpy()))
    prompt, decode = [5, 17, 60, 3, 42, 9], [11, 70, 7]
    want = run_logits(model, load_adapter(root / "peft", model), prompt, decode)
    got = run_logits(model, from_seed, prompt, decode)
    base = run_logits(model, None, prompt, decode)
    assert (want - base).abs().max() > 0.1, "the adapter must change the logits"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_seed_to_peft_loads_in_transformers_peft(tiny, tmp_path):
    """seed tensors -> a PEFT dir that PEFT itself reads (module paths, ranks, scaling 1) = the original."""
    root, peft_model = tiny
    registry = default_registry()
    spec = registry.get("LlamaForCausalLM")
    weights, config = peft_to_trtllm(root / "peft", spec, registry, torch.float32)
    model = Engine.load(root / "ckpt").model
    source = trtllm_tensors.read_rows(weights, config, lambda m, i: module_dims(model, m, i))
    write_peft(tmp_path / "back", *trtllm_to_peft(source, spec))
    back = peft.PeftModel.from_pretrained(tiny_llama(0), tmp_path / "back").eval()
    ids = torch.tensor([[5, 17, 60, 3, 42, 9]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_cli_convert_lora_both_ways(tiny, tmp_path, capsys):
    root, _ = tiny

    def _cli(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)

    done = _cli("convert", "--lora_dir", str(root / "peft"), "--output_dir", str(tmp_path / "seed"),
                "--storage_type", "float16")
    assert done.returncode == 0, done.stderr
    weights = np.load(tmp_path / "seed" / "model.lora_weights.npy")
    config = np.load(tmp_path / "seed" / "model.lora_config.npy")
    assert weights.dtype == np.float16 and weights.shape[:2] == (1, 14) and config.shape == (1, 14, 3)
    done = _cli("convert", "--lora_dir", str(tmp_path / "seed"), "--output_dir", str(tmp_path / "peft_again"),
                "--model_dir", str(root / "ckpt"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "peft_again" / "adapter_model.safetensors").is_file()
    done = _cli("convert", "--lora_dir", str(tmp_path / "seed"), "--output_dir", str(tmp_path / "x"))
    assert done.returncode == 2 and "--model_dir" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    done = _cli("convert", "--lora_dir", str(root / "peft"), "--output_dir", str(tmp_path / "busy"))
    assert done.returncode == 2 and "notes.txt" in done.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]
