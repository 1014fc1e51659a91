"""DeepSeek-V2 / V3 parity rows and the latent cache's bytes: every case of tests/models/test_zoo_deepseek.py.

Per case (tiny random fp32 models from transformers' own config classes, weights re-drawn by
`bestiary.testing.parity.reinit_`, V3's correction bias drawn too), the columns of benchmarks/qwen3_parity.py:
max |ours - HF| over the 12-token prefill and 16 greedy decode steps, max |HF|, the bound, greedy tokens vs HF,
tp 2 and ep 2 engines (max |diff|, greedy vs tp 1), W8A16 / W4A16 relative to max |HF|.

Then the MLA memory figure: a built bf16 engine with DeepSeek-V2's attention dims (128 heads, kv_lora_rank 512,
rope / nope / v 64 / 128 / 128), its KV pool's bytes per token per layer as allocated, against the same attention
stored as full K / V (allocated the same way).

Usage: python benchmarks/deepseek_parity.py. Runs on the CPU in about two minutes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import qwen3_parity

REPO = Path(__file__).resolve().parent.parent


def measure(architecture: str, case, workdir: Path) -> list[str]:
    """qwen3_parity.measure's cells, with tp 2 and ep 2 (tp 2 = ep 2: four whole experts a rank) for every case."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.parity import greedy_mismatch, reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT, reference_chain

    reference = as_reference(case)
    source = reference.save(workdir / "source")
    ckpt = convert(source, workdir / "ckpt", show_progress=False)
    diff, scale = reference_diffs(Engine.load(ckpt), reference.logits, PROMPT, qwen3_parity.STEPS)
    tokens, _, tie = reference_chain(reference, PROMPT, qwen3_parity.STEPS)
    greedy = SamplingConfig(max_new_tokens=qwen3_parity.STEPS, temperature=0.0, ignore_eos=True)
    (out,) = LLM(ckpt).generate([PROMPT], greedy)
    layouts = {"tp2": dict(tp_size=2), "ep2": dict(tp_size=2, moe_ep_size=2)}
    split = [f"{name}: " + qwen3_parity.split_run(source, workdir / name, reference, layout, out.output_ids)
             for name, layout in layouts.items()]
    quant = [f"{qwen3_parity.quantized(source, workdir / algo, reference, algo):.1%}" for algo in ("W8A16", "W4A16")]
    same = "same" if greedy_mismatch(out.output_ids, tokens, tie) is None else "DIFFERS"
    return [f"{diff:.2e}", f"{scale:.2f}", f"{1e-4 * max(1.0, scale):.1e}", same, "; ".join(split), *quant]


def main() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_zoo_deepseek as zoo

    qwen3_parity.measure = measure  # print_table's rows, with ep 2 for every case
    qwen3_parity.print_table({"DeepseekV2ForCausalLM": zoo.V2, "DeepseekV3ForCausalLM": zoo.V3}, "tp 2 / ep 2")
    with tempfile.TemporaryDirectory() as tmp:
        latent, full = zoo.v2_pool_bytes(Path(tmp))
    print(f"\nDeepSeek-V2 attention, bf16: KV pool {latent:,} bytes per token per layer (latent [c ; k_r]); "
          f"full K / V {full:,} ({full / latent:.1f}x); 60 layers: {60 * latent:,} vs {60 * full:,} bytes per token")


if __name__ == "__main__":
    main()
