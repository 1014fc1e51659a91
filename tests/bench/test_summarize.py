"""`bestiary eval --task summarize` on a tiny random LLaMA (fast): the engine's summaries against HF
transformers' on the same articles and prompt, ROUGE from rouge-score, and --check_accuracy passing
for the float32 engine and failing for one whose layer 1 weights are zeroed (a planted fault)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

if importlib.util.find_spec("rouge_score") is None:
    pytest.skip("rouge-score is not installed (the eval extra)", allow_module_level=True)

from bestiary.core.cli.main import main  # noqa: E402

ARTICLES = ["The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.",
            "Hello world! How are you today? I am fine, thank you.",
            "The capital of France is Paris. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12.",
            "def add(a, b):\n    return a + b\n\nCafé, naïve."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny engine, a copy with layer 1 zeroed, and a dataset whose highlights are HF's own summaries
    (so HF scores its best, below 100 only where a summary has no word rouge-score tokenizes, and a
    faulty engine falls below it)."""
    from safetensors.torch import load_file, save_file
    from tiny_chat import make_tiny_chat_engine

    from bestiary.core.bench.summarize import hf_summaries, prompt_text
    from bestiary.core.runtime.tokenizer import Tokenizer

    base = tmp_path_factory.mktemp("summarize")
    make_tiny_chat_engine(base, max_batch_size=4, max_seq_len=256)
    faulty = base / "faulty"
    shutil.copytree(base / "engine", faulty)
    tensors = load_file(faulty / "rank0.safetensors")
    for name in [n for n in tensors if n.startswith("transformer.layers.1.") and "layernorm" not in n]:
        tensors[name] = tensors[name] * 0
    save_file(tensors, faulty / "rank0.safetensors")
    tokenizer = Tokenizer.from_dir(base / "engine")
    assert tokenizer is not None
    prompts = [tokenizer.encode(prompt_text(a)) for a in ARTICLES]
    highlights = hf_summaries(base / "hf", prompts, 16, tokenizer.stop_ids)
    data = base / "articles.jsonl"
    data.write_text("".join(json.dumps({"article": a, "highlights": h}) + "\n" for a, h in zip(ARTICLES, highlights)))
    return base, faulty, data


def run(capsys, engine, data, hf, *flags) -> tuple[int, dict]:
    code = main(["eval", "--engine_dir", str(engine), "--task", "summarize", "--dataset", str(data),
                 "--hf_model_dir", str(hf), "--max_output_len", "16", *flags])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_check_accuracy_passes_for_the_engine_and_fails_for_a_planted_fault(setup, capsys):
    base, faulty, data = setup
    code, report = run(capsys, base / "engine", data, base / "hf", "--check_accuracy", "--rouge1_threshold", "1")
    assert code == 0 and report["check_accuracy"] is True, report
    assert report["identical_to_hf"] == len(ARTICLES) and report["rouge1_vs_hf"] > 50
    assert report["engine"] == pytest.approx(report["hf"])
    code, report = run(capsys, faulty, data, base / "hf", "--check_accuracy", "--rouge1_threshold", "1")
    assert code == 1 and report["check_accuracy"] is False, report
    assert report["engine"]["rouge1"] < report["hf"]["rouge1"] - 1


def test_bad_dataset_and_missing_flags_are_one_line(setup, tmp_path, capsys):
    base, _, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"article": "x"}\n')
    for argv, words in (
        (["--dataset", str(bad), "--hf_model_dir", str(base / "hf")], f"{bad}:1: expected an object with text fields"),
        (["--dataset", str(bad)], "--task summarize needs --hf_model_dir"),
    ):
        assert main(["eval", "--engine_dir", str(base / "engine"), "--task", "summarize", *argv]) == 2
        assert words in capsys.readouterr().err
    assert main(["eval", "--engine_dir", str(base / "engine")]) == 2
    assert "--task perplexity needs --text_file" in capsys.readouterr().err


def test_lora_dir_runs_both_models_with_the_adapter(setup, tmp_path, capsys):
    """--lora_dir: the engine (a LoRA request per article) and HF (through peft) summarize with the same PEFT
    adapter: the same summaries, and different ones from the base models'."""
    import torch
    import transformers
    from lora_helpers import peft_adapter

    base, _, data = setup
    hf = transformers.AutoModelForCausalLM.from_pretrained(base / "hf", dtype=torch.float32)
    adapter = tmp_path / "adapter"
    peft_adapter(hf, adapter, seed=5, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    code, with_adapter = run(capsys, base / "engine", data, base / "hf", "--lora_dir", str(adapter),
                             "--check_accuracy", "--rouge1_threshold", "1")
    assert code == 0 and with_adapter["check_accuracy"] is True, with_adapter
    assert with_adapter["identical_to_hf"] == len(ARTICLES), with_adapter
    _, plain = run(capsys, base / "engine", data, base / "hf")
    assert with_adapter["engine"] != pytest.approx(plain["engine"]), "the adapter changed no summary"
