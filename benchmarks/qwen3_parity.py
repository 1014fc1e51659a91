"""Qwen3 and Qwen3-MoE parity rows: every case of tests/models/test_qwen3*.py against transformers.

Per case (tiny random fp32 models from transformers' own config classes, weights re-drawn by
`bestiary.testing.parity.reinit_`):

- max |ours - HF| over the 12-token prefill and 16 greedy decode steps, max |HF|, the kit's bound;
- greedy: `LLM.generate`'s 16 tokens equal HF's argmax chain (or differ only after a near-tie);
- tp 2 (and, for Qwen3-MoE, ep 2): max |ours - HF| of a two-rank engine, and its greedy tokens equal tp 1's;
- W8A16 / W4A16 (round to nearest, groups of 32): max |quantized - HF| / max |HF| over the prefill.

Usage: python benchmarks/qwen3_parity.py. Runs on the CPU in about a minute.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = 16


def cases() -> dict[str, dict]:
    """architecture -> {case name: case} from the test modules."""
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_qwen3
    import test_qwen3_moe

    return {"Qwen3ForCausalLM": test_qwen3.QWEN3, "Qwen3MoeForCausalLM": test_qwen3_moe.QWEN3_MOE}


def split_run(source: Path, out: Path, reference, layout: dict, tp1: list[int]) -> str:
    """'max|diff|, same/differs' of a multi-rank engine converted with `layout`."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.suite import PROMPT

    llm = LLM(convert(source, out, ConvertOptions(**layout), show_progress=False), num_threads=1)
    try:
        diff, _ = reference_diffs(llm.engine, reference.logits, PROMPT, STEPS)
        (split,) = llm.generate([PROMPT], SamplingConfig(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    return f"{diff:.2e}, {'same' if split.output_ids == tp1 else 'DIFFERS'}"


def quantized(source: Path, out: Path, reference, algo: str) -> float:
    """max |quantized - HF| / max |HF| over the prefill."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.config import QuantConfig
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import EngineRunner
    from bestiary.testing.suite import PROMPT

    options = ConvertOptions(quantization=QuantConfig(quant_algo=algo, group_size=32), weight_quantizer="rtn")
    ours = EngineRunner(Engine.load(convert(source, out, options, show_progress=False))).feed(PROMPT, all_logits=True)
    ref = reference.logits(PROMPT)
    return (ours - ref).abs().max().item() / ref.abs().max().item()


def measure(architecture: str, case, workdir: Path) -> list[str]:
    """One case's cells after the architecture and case names."""
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
    diff, scale = reference_diffs(Engine.load(ckpt), reference.logits, PROMPT, STEPS)
    tokens, _, tie = reference_chain(reference, PROMPT, STEPS)
    (out,) = LLM(ckpt).generate([PROMPT], SamplingConfig(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True))
    layouts = {"tp2": dict(tp_size=2)} | ({"ep2": dict(tp_size=2, moe_ep_size=2)} if "Moe" in architecture else {})
    split = [f"{name}: " + split_run(source, workdir / name, reference, layout, out.output_ids)
             for name, layout in layouts.items()]
    quant = [f"{quantized(source, workdir / algo, reference, algo):.1%}" for algo in ("W8A16", "W4A16")]
    greedy = "same" if greedy_mismatch(out.output_ids, tokens, tie) is None else "DIFFERS"
    return [f"{diff:.2e}", f"{scale:.2f}", f"{1e-4 * max(1.0, scale):.1e}", greedy, "; ".join(split), *quant]


def print_table(cases_by_architecture: dict[str, dict], split: str = "tp 2") -> None:
    """The Markdown parity table of every case (`split`: what the tp column measures), a row as it is measured."""
    header = ["architecture", "case", "max \\|diff\\|", "max \\|ref\\|", "bound", "greedy (16)",
              f"{split}: max \\|diff\\|, greedy vs tp 1", "W8A16", "W4A16"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for architecture, named in cases_by_architecture.items():
        for name, case in named.items():
            with tempfile.TemporaryDirectory() as tmp:
                print("| " + " | ".join([architecture, name, *measure(architecture, case, Path(tmp))]) + " |",
                      flush=True)


def main() -> None:
    print_table(cases(), "tp 2 / ep 2")


if __name__ == "__main__":
    main()
