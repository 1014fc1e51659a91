"""gpt-oss parity rows: the cases of tests/models/test_zoo_gpt_oss.py (and its MXFP4 source) against transformers.

Per case, as benchmarks/qwen3_parity.py measures them: max |ours - HF| over the 12-token prefill and 16
greedy decode steps, max |HF|, the kit's bound; greedy tokens; tp 2 and ep 2 engines (max |ours - HF|,
greedy vs tp 1); W8A16 / W4A16 of the dense linears (round to nearest, groups of 32; the experts stay float)
relative to max |HF|. The `mxfp4` row converts a checkpoint whose experts are MXFP4 blocks / scales against
transformers on the dequantized weights.

Usage: python benchmarks/gpt_oss_parity.py. Runs on the CPU in under a minute.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = 16


def measure(reference, source: Path, workdir: Path) -> list[str]:
    """One case's cells after the case name."""
    from qwen3_parity import quantized, split_run

    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.parity import greedy_mismatch, reference_diffs
    from bestiary.testing.suite import PROMPT, reference_chain

    ckpt = convert(source, workdir / "ckpt", show_progress=False)
    diff, scale = reference_diffs(Engine.load(ckpt), reference.logits, PROMPT, STEPS)
    tokens, _, tie = reference_chain(reference, PROMPT, STEPS)
    (out,) = LLM(ckpt).generate([PROMPT], SamplingConfig(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True))
    split = [f"{name}: " + split_run(source, workdir / name, reference, layout, out.output_ids)
             for name, layout in {"tp2": dict(tp_size=2), "ep2": dict(tp_size=2, moe_ep_size=2)}.items()]
    quant = [f"{quantized(source, workdir / algo, reference, algo):.1%}" for algo in ("W8A16", "W4A16")]
    greedy = "same" if greedy_mismatch(out.output_ids, tokens, tie) is None else "DIFFERS"
    return [f"{diff:.2e}", f"{scale:.2f}", f"{1e-4 * max(1.0, scale):.1e}", greedy, "; ".join(split), *quant]


def main() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_zoo_gpt_oss as t

    from bestiary.testing.references import as_reference

    header = ["architecture", "case", "max \\|diff\\|", "max \\|ref\\|", "bound", "greedy (16)",
              "tp 2 / ep 2: max \\|diff\\|, greedy vs tp 1", "W8A16", "W4A16"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, case in [*t.GPT_OSS.items(), ("mxfp4", t.GPT_OSS["banded_sinks"])]:
        with tempfile.TemporaryDirectory() as tmp:
            reference = as_reference(case)
            if name == "mxfp4":
                t._mxfp4_source(reference, Path(tmp) / "source")
                source = Path(tmp) / "source"
            else:
                source = reference.save(Path(tmp) / "source")
            print("| " + " | ".join(["GptOssForCausalLM", name, *measure(reference, source, Path(tmp))]) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
