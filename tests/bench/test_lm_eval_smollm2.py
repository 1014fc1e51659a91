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


def run_lm_eval(model: str, model_args: str, tasks, output, names: str = "bestiary_mc,bestiary_gen") -> float:
    """`bestiary lm-eval` with the local tasks `names` at batch size 4; returns its wall time in seconds."""
    from bestiary.core.cli.main import main

    start = time.perf_counter()
    assert main(["lm-eval", "--model", model, "--model_args", model_args, "--tasks", names,
                 "--include_path", str(tasks), "--batch_size", "4", "--device", "cpu", "--log_samples",
                 "--output_path", str(output)]) == 0
    return time.perf_counter() - start


def test_bestiary_matches_lm_eval_hf_on_smollm2(smollm2_fp32_engine, hf_model, hf_tokenizer, tmp_path):
    tasks = write_tasks(tmp_path)
    hf_dir = dense_hf_copy(hf_model, hf_tokenizer, tmp_path / "hf")
    ours = run_lm_eval("bestiary", f"engine_dir={smollm2_fp32_engine}", tasks, tmp_path / "bestiary")
    theirs = run_lm_eval("hf", f"pretrained={hf_dir},dtype=float32", tasks, tmp_path / "hf_out")
    print(f"lm-eval wall time: bestiary {ours:.1f} s, hf {theirs:.1f} s ({theirs / ours:.2f}x)")
    same_mc_answers(tmp_path / "bestiary", tmp_path / "hf_out")
    gen_a, gen_b = read_samples(tmp_path / "bestiary", "bestiary_gen"), read_samples(tmp_path / "hf_out", "bestiary_gen")
    assert [r["filtered_resps"] for r in gen_a] == [r["filtered_resps"] for r in gen_b]


def same_mc_answers(ours, theirs) -> list[float]:
    """The multiple-choice task's accuracy equal in both output dirs and every per-choice loglikelihood within
    1e-3; returns our loglikelihoods."""
    a, b = read_results(ours), read_results(theirs)
    assert a["bestiary_mc"]["acc,none"] == b["bestiary_mc"]["acc,none"]
    mc_a, mc_b = read_samples(ours, "bestiary_mc"), read_samples(theirs, "bestiary_mc")
    assert len(mc_a) == len(mc_b) == 48
    logps = []
    for row_a, row_b in zip(mc_a, mc_b):
        for (logp_a, _), (logp_b, _) in zip(row_a["filtered_resps"], row_b["filtered_resps"]):
            assert abs(float(logp_a) - float(logp_b)) < 1e-3, (row_a["doc_id"], logp_a, logp_b)
            logps.append(float(logp_a))
    return logps


def test_lora_adapter_matches_lm_eval_hf_with_peft(smollm2_fp32_engine, hf_model, hf_tokenizer, tmp_path):
    """`--model bestiary` with `lora_dir` = lm-eval's `--model hf` with `peft=` (the same PEFT adapter on q, v, o
    and the MLP's down projection): the same accuracy, every per-choice loglikelihood within 1e-3; and the
    adapter moves the scores (the base engine's differ by more than 0.05 somewhere)."""
    import transformers
    from lora_helpers import peft_adapter

    tasks = write_tasks(tmp_path)
    hf_dir = dense_hf_copy(hf_model, hf_tokenizer, tmp_path / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)  # PEFT wraps it in place
    peft_adapter(base, tmp_path / "adapter", seed=5, b_scale=0.5, r=8, lora_alpha=16,
                 target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    adapter = tmp_path / "adapter"
    ours = run_lm_eval("bestiary", f"engine_dir={smollm2_fp32_engine},lora_dir={adapter}", tasks,
                       tmp_path / "bestiary", names="bestiary_mc")
    theirs = run_lm_eval("hf", f"pretrained={hf_dir},dtype=float32,peft={adapter}", tasks, tmp_path / "hf_out",
                         names="bestiary_mc")
    plain = run_lm_eval("bestiary", f"engine_dir={smollm2_fp32_engine}", tasks, tmp_path / "plain", names="bestiary_mc")
    print(f"lm-eval wall time with the adapter: bestiary {ours:.1f} s, hf + peft {theirs:.1f} s "
          f"({theirs / ours:.2f}x); base engine {plain:.1f} s")
    with_adapter = same_mc_answers(tmp_path / "bestiary", tmp_path / "hf_out")
    without = [float(lp) for row in read_samples(tmp_path / "plain", "bestiary_mc") for lp, _ in row["filtered_resps"]]
    assert max(abs(a - b) for a, b in zip(with_adapter, without)) > 0.05
    print("accuracy with the adapter", read_results(tmp_path / "bestiary")["bestiary_mc"]["acc,none"],
          "without", read_results(tmp_path / "plain")["bestiary_mc"]["acc,none"])
