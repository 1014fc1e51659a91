"""lm-eval's `--model bestiary` on the float32 SmolLM2 engine against lm-eval's own `--model hf` on the
dense HF copy of the same GGUF (slow: two lm-eval runs of a real model). Local tasks only
(tests/bench/lm_eval_tasks.py): 48 multiple-choice questions (192 loglikelihood requests) and 12
generate_until questions. Must hold: the same accuracy, every per-choice loglikelihood within 1e-3,
the same greedy outputs."""

from __future__ import annotations

import copy
import importlib.util
import time

import pytest

if importlib.util.find_spec("lm_eval") is None:
    pytest.skip("lm-eval is not installed (the eval extra)", allow_module_level=True)
import torch  # noqa: E402
from lm_eval_tasks import read_results, read_samples, write_tasks  # noqa: E402

pytestmark = pytest.mark.slow


def dense_hf_copy(hf_model, hf_tokenizer, directory):
    """The GGUF-loaded HF model saved as a plain float32 HF dir (transformers refuses to save a model it
    loaded from GGUF: the copy is a fresh model of the same config holding the same tensors)."""
    import transformers

    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(hf_model.state_dict())
    model.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    return directory


def run_lm_eval(model: str, model_args: str, tasks, output) -> float:
    """`bestiary lm-eval` with both local tasks at batch size 4; returns its wall time in seconds."""
    from bestiary.core.cli.main import main

    start = time.perf_counter()
    assert main(["lm-eval", "--model", model, "--model_args", model_args, "--tasks", "bestiary_mc,bestiary_gen",
                 "--include_path", str(tasks), "--batch_size", "4", "--device", "cpu", "--log_samples",
                 "--output_path", str(output)]) == 0
    return time.perf_counter() - start


def test_bestiary_matches_lm_eval_hf_on_smollm2(smollm2_fp32_engine, hf_model, hf_tokenizer, tmp_path):
    tasks = write_tasks(tmp_path)
    hf_dir = dense_hf_copy(hf_model, hf_tokenizer, tmp_path / "hf")
    ours = run_lm_eval("bestiary", f"engine_dir={smollm2_fp32_engine}", tasks, tmp_path / "bestiary")
    theirs = run_lm_eval("hf", f"pretrained={hf_dir},dtype=float32", tasks, tmp_path / "hf_out")
    print(f"lm-eval wall time: bestiary {ours:.1f} s, hf {theirs:.1f} s ({theirs / ours:.2f}x)")
    a, b = read_results(tmp_path / "bestiary"), read_results(tmp_path / "hf_out")
    assert a["bestiary_mc"]["acc,none"] == b["bestiary_mc"]["acc,none"]
    mc_a, mc_b = read_samples(tmp_path / "bestiary", "bestiary_mc"), read_samples(tmp_path / "hf_out", "bestiary_mc")
    assert len(mc_a) == len(mc_b) == 48
    for row_a, row_b in zip(mc_a, mc_b):
        for (logp_a, _), (logp_b, _) in zip(row_a["filtered_resps"], row_b["filtered_resps"]):
            assert abs(float(logp_a) - float(logp_b)) < 1e-3, (row_a["doc_id"], logp_a, logp_b)
    gen_a, gen_b = read_samples(tmp_path / "bestiary", "bestiary_gen"), read_samples(tmp_path / "hf_out", "bestiary_gen")
    assert [r["filtered_resps"] for r in gen_a] == [r["filtered_resps"] for r in gen_b]
