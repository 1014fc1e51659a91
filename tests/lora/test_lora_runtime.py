"""LoRA in the executor, the Python API and the CLI: mixed batches, errors that name the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import parity  # noqa: E402
from lora_helpers import peft_adapter  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 60, 3, 42], [8, 61, 27], [11, 70, 7, 33, 2, 90, 14], [4, 4, 9], [50, 1], [19, 23, 29, 31]]
GREEDY = SamplingConfig(temperature=0, max_new_tokens=10, ignore_eos=True)


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    return parity.reinit_(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), seed=seed)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny LLaMA checkpoint and three adapters of ranks 4, 8 and 16 on different modules."""
    root = tmp_path_factory.mktemp("lora_rt")
    convert(parity.save_hf(_llama(), root), root / "ckpt", show_progress=False)
    dirs = {}
    for r, targets in ((4, TARGETS), (8, ["q_proj", "v_proj", "down_proj"]), (16, ["k_proj", "o_proj", "up_proj"])):
        peft_adapter(_llama(), root / f"r{r}", seed=r, b_scale=2.0, r=r, lora_alpha=2 * r, target_modules=targets)
        dirs[r] = root / f"r{r}"
    return root, dirs


def test_a_mixed_batch_equals_each_request_alone(setup):
    """Ranks 4, 8, 16 and base requests in one in-flight batch (prefill + compiled decode) = one by one."""
    root, dirs = setup
    llm = LLM(root / "ckpt")
    lora = [LoraRequest(f"r{r}", dirs[r]) if r else None for r in (4, 0, 8, 16, 4, 0)]
    together = [c.output_ids for c in llm.generate(PROMPTS, GREEDY, lora=lora)]
    alone = [llm.generate([p], GREEDY, lora=[a])[0].output_ids for p, a in zip(PROMPTS, lora)]
    assert together == alone
    assert together[0] != llm.generate([PROMPTS[0]], GREEDY)[0].output_ids, "the adapter must change the text"
    assert together[0] != together[4] or PROMPTS[0] == PROMPTS[4]
    llm.executor.check_kv_accounting()


def test_compiled_decode_with_mixed_adapters_equals_the_eager_path(setup):
    """Decode steps of a mixed batch on the compiled plan (its LoRA records: each row its own adapter's
    A and B) give the eager torch path's logits (StepLora's mask form over every adapter's ranks). The
    requests end one after the other: the plans of the smaller batches are the first one resized, and
    bind the step's adapters anew."""
    from bestiary.core.kernels import dispatch

    root, dirs = setup
    lora = [LoraRequest(f"r{r}", dirs[r]) if r else None for r in (4, 0, 8, 16, 4, 0)]
    cfg = [SamplingConfig(temperature=0, max_new_tokens=n, ignore_eos=True, output_generation_logits=True)
           for n in (6, 3, 8, 4, 6, 7)]
    llm = LLM(root / "ckpt")
    planned = llm.generate(PROMPTS, cfg, lora=lora)
    steps = llm.executor.model.__dict__.get("plan_steps", 0)
    assert steps >= 7, llm.executor.model.decode_plan_status()  # the decode steps ran as the plan
    plans = llm.executor.model.__dict__["_decode_plans"]
    assert all(plans.get(b) is not None for b in (6, 5, 4, 2, 1)), sorted(plans)
    with dispatch.kernels_mode("torch"):
        eager = LLM(root / "ckpt").generate(PROMPTS, cfg, lora=lora)
    for a, b in zip(planned, eager):
        assert a.output_ids == b.output_ids
        scale = b.generation_logits.abs().max().item()
        assert (a.generation_logits - b.generation_logits).abs().max().item() <= 1e-4 * scale


def test_adapters_load_once_and_keep_their_own_prefix_cache(setup):
    root, dirs = setup
    llm = LLM(root / "ckpt")
    prompt = list(range(1, 40))  # > 2 KV blocks: reuse possible
    first = llm.generate([prompt], GREEDY, lora=LoraRequest("a", dirs[4]))[0].output_ids
    adapter = llm.lora_store.adapters["a"]
    base = llm.generate([prompt], GREEDY)[0].output_ids  # the base model must not reuse the adapter's K/V
    again = llm.generate([prompt], GREEDY, lora=LoraRequest("a"))[0].output_ids  # by name, no path
    assert llm.lora_store.adapters["a"] is adapter and again == first and base != first
    with pytest.raises(BestiaryError, match="already loaded from"):
        llm.generate([prompt], GREEDY, lora=LoraRequest("a", dirs[8]))
    with pytest.raises(BestiaryError, match="2 LoraRequests for 1 prompts"):
        llm.generate([prompt], GREEDY, lora=[None, None])


def test_streaming_with_an_adapter_equals_generate(setup):
    root, dirs = setup
    llm = LLM(root / "ckpt")
    lora = LoraRequest("r8", dirs[8])
    assert list(llm.generate_stream(PROMPTS[2], GREEDY, lora=lora)) == llm.generate([PROMPTS[2]], GREEDY, lora=lora)[0].output_ids


# --- bad adapters: one line each ------------------------------------------------------------


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


BAD = {
    "unknown target": (lambda d: _edit_config(d, target_modules=["q_proj", "qkv_projj"]),
                       "unknown target module 'qkv_projj' for LlamaForCausalLM; nearest valid module"),
    "unsupported method": (lambda d: _edit_config(d, use_dora=True), "use_dora = True: DoRA"),
    "other PEFT type": (lambda d: _edit_config(d, peft_type="IA3"), "peft_type 'IA3' is not supported"),
    "missing weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors or"),
    "other architecture": (lambda d: _edit_config(d, target_modules=["query_key_value"]),
                           "'query_key_value' is a module of ChatGLM2ForCausalLM, ChatGLMForCausalLM, "
                           "FalconForCausalLM: this adapter was made for another architecture"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_adapters_are_refused_in_one_line(case, setup, tmp_path):
    root, dirs = setup
    bad = _copy(dirs[8], tmp_path / "bad")
    edit, message = BAD[case]
    edit(bad)
    llm = LLM(root / "ckpt")
    with pytest.raises(BestiaryError) as err:
        llm.generate([PROMPTS[0]], GREEDY, lora=LoraRequest("bad", bad))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].output_ids  # the engine still serves


def test_shape_mismatch_and_foreign_layout_name_the_tensor(setup, tmp_path):
    root, _ = setup
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "hidden_size": 32, "num_attention_heads": 2,
                                                                      "num_key_value_heads": 1}))
    peft_adapter(wide, tmp_path / "wide", r=4, lora_alpha=8, target_modules=["q_proj"])
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=96, hidden_size=64, num_attention_heads=4,
                                                             ffn_dim=96, num_hidden_layers=2, word_embed_proj_dim=64))
    peft_adapter(opt, tmp_path / "opt", r=4, lora_alpha=8, target_modules=["q_proj"])
    llm = LLM(root / "ckpt")
    with pytest.raises(BestiaryError, match=r"layers.0.self_attn.q_proj: lora_A has shape \(4, 32\), the base model "
                                            r"needs \(4, 64\)"):
        llm.generate([PROMPTS[0]], GREEDY, lora=LoraRequest("wide", tmp_path / "wide"))
    with pytest.raises(BestiaryError, match=r"under 'model.decoder.layers' \(the layout of OPTForCausalLM\)"):
        llm.generate([PROMPTS[0]], GREEDY, lora=LoraRequest("opt", tmp_path / "opt"))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bestiary", *map(str, args)], capture_output=True, text=True)


def test_cli_runs_adapters_per_input_and_refuses_bad_ones(setup, tmp_path):
    root, dirs = setup
    ids = [",".join(map(str, p)) for p in PROMPTS[:3]]
    out = _cli("run", "--engine_dir", root / "ckpt", "--input_ids", *ids, "--lora_dir", dirs[4], dirs[16],
               "--lora_task_uids", "0", "-1", "1", "--max_output_len", 10, "--temperature", 0, "--ignore_eos",
               "--output_ids")
    assert out.returncode == 0, out.stderr
    llm = LLM(root / "ckpt")
    want = llm.generate(PROMPTS[:3], GREEDY, lora=[LoraRequest("x", dirs[4]), None, LoraRequest("y", dirs[16])])
    assert out.stdout.split("\n")[:3] == [" ".join(map(str, c.output_ids)) for c in want]
    bad = _copy(dirs[8], tmp_path / "bad")
    _edit_config(bad, target_modules=["q_proj", "qkv_projj"])
    for args, message in (
        (("--lora_dir", bad), "unknown target module 'qkv_projj'"),
        (("--lora_dir", tmp_path / "nowhere"), "no such adapter directory"),
        (("--lora_dir", dirs[4], "--lora_task_uids", "0", "2", "1"), "--lora_task_uids: 2 is not -1 or an index"),
        (("--lora_dir", dirs[4], "--lora_task_uids", "0"), "--lora_task_uids has 1 values for 3 inputs"),
    ):
        out = _cli("run", "--engine_dir", root / "ckpt", "--input_ids", *ids, "--max_output_len", 2, *args)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
