"""`bestiary build --lora_dir ... --max_lora_rank --lora_target_modules`: adapters bundled in the engine,
picked by `bestiary run --lora_task_uids`; limits refused at build with nothing written."""

from __future__ import annotations

import json
import re

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import parity  # noqa: E402
from lora_helpers import peft_adapter, tiny_llama  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

PROMPTS = ["5,17,60,3,42", "8,61,27", "11,70,7,33,2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bundle")
    convert(parity.save_hf(tiny_llama(), root), root / "ckpt", ConvertOptions(dtype="float32"), show_progress=False)
    peft_adapter(tiny_llama(), root / "qv4", seed=4, b_scale=2.0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_adapter(tiny_llama(), root / "all8", seed=8, b_scale=2.0, r=8, lora_alpha=4,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return root


def _main(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bundled_adapters_run_by_task_uid(setup, tmp_path, capsys):
    root = setup
    code, _, err = _main(capsys, "build", "--checkpoint_dir", root / "ckpt", "--output_dir", tmp_path / "engine",
                         "--lora_dir", root / "qv4", root / "all8", "--max_lora_rank", 8)
    assert code == 0, err
    lora = json.loads((tmp_path / "engine" / "config.json").read_text())["lora"]
    assert lora["max_lora_rank"] == 8 and lora["lora_target_modules"][:3] == ["attn_q", "attn_k", "attn_v"]
    assert [(a["task_uid"], a["name"], a["max_rank"], a["file"]) for a in lora["adapters"]] == [
        ("0", "qv4", 4, "lora/0.safetensors"), ("1", "all8", 8, "lora/1.safetensors")]
    assert lora["adapters"][0]["modules"] == ["attn_q", "attn_v"]
    code, out, err = _main(capsys, "run", "--engine_dir", tmp_path / "engine", "--input_ids", *PROMPTS,
                           "--lora_task_uids", "1", "-1", "0", "--output_ids", "--max_output_len", 6, "--ignore_eos")
    assert code == 0, err
    got = [list(map(int, line.split())) for line in out.strip().splitlines()]
    llm = LLM(root / "ckpt")
    ids = [[int(t) for t in p.split(",")] for p in PROMPTS]
    lora = [LoraRequest("all8", root / "all8"), None, LoraRequest("qv4", root / "qv4")]
    want = [c.output_ids for c in llm.generate(ids, SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True),
                                               lora=lora)]
    assert got == want
    code, _, err = _main(capsys, "run", "--engine_dir", tmp_path / "engine", "--input_ids", *PROMPTS,
                         "--lora_task_uids", "1", "-1", "2")
    assert code == 2 and "'2' is not -1 or a task uid of the engine's adapters (0, 1)" in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--max_lora_rank", "4"], r"all8: model\.layers\.0\.\S+ has rank 8, above --max_lora_rank 4"),
    (["--lora_target_modules", "attn_q", "attn_v"], r"all8: model\.layers\.0\.\S+ adapts (attn_k|attn_dense|mlp_\w+), which is not in --lora_target_modules \(attn_q, attn_v\)"),
    (["--lora_target_modules", "attn_qq"], "--lora_target_modules attn_qq: unknown LoRA module"),
    (["--lora_target_modules", "moe_router"], "LlamaForCausalLM takes only attn_q"),
])
def test_limits_are_refused_at_build(setup, tmp_path, capsys, flags, message):
    root = setup
    code, _, err = _main(capsys, "build", "--checkpoint_dir", root / "ckpt", "--output_dir", tmp_path / "engine",
                         "--lora_dir", root / "qv4", root / "all8", *flags)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "engine").exists()


def test_run_time_adapters_keep_to_the_engine_limits(setup, tmp_path, capsys):
    root = setup
    code, _, err = _main(capsys, "build", "--checkpoint_dir", root / "ckpt", "--output_dir", tmp_path / "engine",
                         "--lora_dir", root / "qv4", "--lora_target_modules", "attn_q", "attn_v")
    assert code == 0, err
    llm = LLM(tmp_path / "engine")
    greedy = SamplingConfig(temperature=0, max_new_tokens=2)
    assert llm.generate([[5, 17, 60]], greedy, lora=LoraRequest("qv4", root / "qv4"))[0].output_ids
    with pytest.raises(BestiaryError, match=r"LoRA task 'big': model\.layers\.0\.\S+ (has rank 8, above the engine's "
                                            r"max_lora_rank 4|adapts \w+, not in the engine's lora_target_modules)"):
        llm.generate([[5, 17, 60]], greedy, lora=LoraRequest("big", root / "all8"))
    assert not llm.lora_store.held and "big" not in llm.lora_store.host.entries
