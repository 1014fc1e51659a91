"""Every built-in family on a CUDA device against its reference on the same device.

    python benchmarks/gpu_parity.py OUT.json [--all-cases] [--device cuda]

Per family (the tiny random configs of the test suite; the first case of each, then with
--all-cases every other case), two checks:

- fp32, TF32 off: max |ours - reference| over the prefill of a 12-token prompt and 6 greedy
  decode steps (the decode steps replay CUDA graphs where the model allows) within
  1e-3 * max(1, max|reference|);
- bf16: `LLM.generate` greedy tokens (the executor, CUDA graphs included) equal the reference's
  greedy chain in bf16, except from the first step whose top-2 margin is under 0.05.

The reference is transformers on the same GPU for the families it has a class for, and for
Qwen-1 / Baichuan (remote code) the plain-torch forward transcribed in tests/models/test_zoo_remote.py
(on the CPU, fp32; their bf16 chain is compared the same way). Rows are written to OUT.json as
each case ends (a hang loses only the case in flight).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FP32_BOUND = 1e-3  # x max(1, max|reference|)
BF16_MARGIN = 0.05  # greedy steps after a top-2 margin under this may differ
PROMPT = [3, 17, 42, 5, 88, 9, 61, 23, 7, 70, 11, 34]
DECODE_STEPS, GREEDY_TOKENS = 6, 12

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)
# The families whose cases live in test modules with fixtures rather than a ZOO table.
OWN_CASES: dict[str, dict[str, dict]] = {
    "LlamaForCausalLM": {"gqa_untied": dict(model_type="llama", **TINY, num_key_value_heads=2, rms_norm_eps=1e-5),
                         "mqa_bias_llama3": dict(model_type="llama", **TINY, num_key_value_heads=1, attention_bias=True,
                                                 mlp_bias=True, rope_theta=500.0, rope_scaling={
                                                     "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32})},
    "MixtralForCausalLM": {"top2_of_4": dict(model_type="mixtral", **TINY, num_key_value_heads=2, num_local_experts=4,
                                             num_experts_per_tok=2)},
    "FalconForCausalLM": {"7b_shape": dict(model_type="falcon", vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, multi_query=True, parallel_attn=True, bias=False),
                          "rw_alibi": dict(model_type="falcon", vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=16, multi_query=False, parallel_attn=False, bias=True,
                                           alibi=True)},
    "OPTForCausalLM": {"pre_norm": dict(model_type="opt", vocab_size=96, hidden_size=32, num_hidden_layers=3, ffn_dim=48,
                                        num_attention_heads=4, max_position_embeddings=64)},
    "ChatGLM2ForCausalLM": {"glm4": dict(model_type="glm", vocab_size=96, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=256, attention_bias=True, pad_token_id=0,
                                         eos_token_id=1)},
}


def cases(all_cases: bool, only: str = "") -> list[tuple[str, str, object]]:
    """(family, case name, case) for every built-in family (or the comma-separated `only`): the first
    case each, or all."""
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_zoo_hf
    import test_zoo_remote

    table = OWN_CASES | test_zoo_hf.ZOO | test_zoo_remote.ZOO
    if only:
        table = {family: c for family, c in table.items() if family in only.split(",")}
    first = [(family, *next(iter(c.items()))) for family, c in table.items()]
    rest = [(family, name, case) for family, c in table.items() for name, case in list(c.items())[1:]]
    return first + rest if all_cases else first  # every family before any second case


def reference_on(case, device: str, dtype: torch.dtype, workdir: Path):
    """(the saved fp32 source dir, the reference in `dtype`): transformers on `device`, or a
    FunctionReference on the CPU; its `logits(ids)` is [T, V] float32 on the CPU."""
    from bestiary.testing.references import HFReference, as_reference

    ref = as_reference(case)
    source = ref.save(workdir / "source")
    if isinstance(ref, HFReference):
        ref.model.to(device=device, dtype=dtype)  # hf_logits feeds the ids on the model's device
    return source, ref


def fp32_row(case, device: str, workdir: Path) -> dict:
    """max |ours - reference| in fp32 (TF32 off) over prefill + decode, and whether graphs ran."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import reference_diffs

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    source, ref = reference_on(case, device, torch.float32, workdir)
    engine = Engine.load(convert(source, workdir / "fp32", ConvertOptions(dtype="float32"), show_progress=False),
                         device=device)
    diff, scale = reference_diffs(engine, ref.logits, PROMPT, DECODE_STEPS)
    bound = FP32_BOUND * max(1.0, scale)
    return {"fp32_diff": diff, "fp32_bound": bound, "fp32_pass": diff <= bound, **graph_state(engine.model)}


def bf16_row(case, device: str, workdir: Path) -> dict:
    """bf16 greedy tokens of LLM.generate against the reference's bf16 chain (near-ties excused)."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.suite import reference_chain

    source, ref = reference_on(case, device, torch.bfloat16, workdir / "bf16ref")
    ckpt = convert(source, workdir / "bf16", ConvertOptions(dtype="bfloat16"), show_progress=False)
    llm = LLM(ckpt, device=device)
    greedy = SamplingConfig(temperature=0, max_new_tokens=GREEDY_TOKENS, ignore_eos=True)
    ours = llm.generate([PROMPT], greedy)[0].output_ids
    chain, rows, _ = reference_chain(ref, PROMPT, GREEDY_TOKENS)
    margins = [float(top2[0] - top2[1]) for top2 in (row.topk(2).values for row in rows)]  # each step's top-2 gap
    tie = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), len(chain))
    first = next((i for i, (a, b) in enumerate(zip(ours, chain)) if a != b), None)
    return {"bf16_pass": ours[:tie] == chain[:tie], "bf16_first_diff": first, "bf16_first_near_tie": tie,
            "bf16_ours": ours, "bf16_ref": chain, **{f"bf16_{k}": v for k, v in graph_state(llm.engine.model).items()}}


def graph_state(model) -> dict:
    """How many decode batch sizes replayed CUDA graphs, and why not where they did not."""
    return {"graphs": len(model.__dict__.get("_cuda_graphs", {})), "graph_refusal": model.__dict__.get("cuda_graph_refusal")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file the rows are written to (rewritten after each case)")
    parser.add_argument("--all-cases", action="store_true", help="every case of each family, not the first")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--only", default="", help="comma-separated architecture names (default: every family)")
    args = parser.parse_args()
    rows = []
    for family, name, case in cases(args.all_cases, args.only):
        row: dict = {"family": family, "case": name}
        start = time.perf_counter()
        for check in (fp32_row, bf16_row):
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    row |= check(case, args.device, Path(tmp))
            except Exception as err:  # one failing family does not hide the others
                row[f"{check.__name__}_error"] = f"{type(err).__name__}: {err}"[:2000]
                traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"{family:24s} {name:16s} fp32 {row.get('fp32_pass')} ({row.get('fp32_diff', float('nan')):.2e} / "
              f"{row.get('fp32_bound', float('nan')):.1e})  bf16 {row.get('bf16_pass')}  graphs {row.get('graphs')} "
              f"{row.get('graph_refusal') or ''}  {row['seconds']}s", flush=True)
    return 0 if all(r.get("fp32_pass") and r.get("bf16_pass") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
