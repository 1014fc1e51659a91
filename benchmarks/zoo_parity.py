"""The model zoo's parity table: every built-in family and variant of tests/test_zoo_*.py against its reference.

Per case (the conformance kit's tiny configs and references: transformers for the families it has,
the transcribed upstream forward for Qwen-1 and Baichuan):

- max |ours - reference| over the prefill and 6 greedy decode steps (fp32), and max |reference|;
- greedy: `LLM.generate` tokens equal the reference's argmax chain (or the first near-tie);
- tp2 x pp2: the split convert reassembles to the tp 1 tensors exactly;
- W8A16: max |quantized - reference| / max |reference|.

Usage: python benchmarks/zoo_parity.py [--only ARCH]. Runs on the CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def zoo() -> dict[str, dict]:
    """architecture -> {case name: case} from the test modules."""
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_zoo_hf
    import test_zoo_remote

    return test_zoo_hf.ZOO | test_zoo_remote.ZOO


def measure(architecture: str, case, workdir: Path) -> dict:
    """One case's row: max diff, scale, greedy, tp/pp reassembly, W8A16 relative diff."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.checkpoint import load_rank_weights
    from bestiary.core.format.config import QuantConfig
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.registry import default_registry
    from bestiary.testing.parity import EngineRunner, greedy_mismatch, reassemble_checkpoint, reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT, reference_chain

    reg = default_registry()
    ref = as_reference(case)
    source = ref.save(workdir / "source")
    ckpt = convert(source, workdir / "ckpt", registry=reg, show_progress=False)
    engine = Engine.load(ckpt, registry=reg)
    diff, scale = reference_diffs(engine, ref.logits, PROMPT, 6, 0)
    tokens, _, tie = reference_chain(ref, PROMPT, 6)
    (out,) = LLM(ckpt, registry=reg).generate([PROMPT], SamplingConfig(max_new_tokens=6, temperature=0.0,
                                                                       ignore_eos=True))
    split = convert(source, workdir / "tp2pp2", ConvertOptions(tp_size=2, pp_size=2), registry=reg, show_progress=False)
    whole, joined = load_rank_weights(ckpt, 0), reassemble_checkpoint(split, reg)
    if "lm_head.weight" not in whole and engine.model.tie_word_embeddings:
        whole["lm_head.weight"] = whole["transformer.vocab_embedding.weight"]
    same = sorted(whole) == sorted(joined) and all(torch.equal(joined[k], v) for k, v in whole.items())
    q = convert(source, workdir / "w8a16", ConvertOptions(quantization=QuantConfig(quant_algo="W8A16")), registry=reg,
                show_progress=False)
    ours_q = EngineRunner(Engine.load(q, registry=reg)).feed(PROMPT, all_logits=True)
    ref_logits = ref.logits(PROMPT)
    return {"diff": diff, "scale": scale, "greedy": greedy_mismatch(out.output_ids, tokens, tie) is None,
            "tp_pp": same, "w8a16": (ours_q - ref_logits).abs().max().item() / ref_logits.abs().max().item()}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one architecture name")
    args = parser.parse_args()
    table = Table(title="model zoo parity (fp32, prompt 12 tokens + 6 greedy steps)")
    for col in ("architecture", "case", "max|diff|", "max|ref|", "bound 1e-4*max(1,ref)", "greedy", "tp2 x pp2",
                "W8A16 rel. diff"):
        table.add_column(col)
    for architecture, cases in zoo().items():
        if args.only and architecture != args.only:
            continue
        for name, case in cases.items():
            with tempfile.TemporaryDirectory() as tmp:
                r = measure(architecture, case, Path(tmp))
            table.add_row(architecture, name, f"{r['diff']:.2e}", f"{r['scale']:.2f}",
                          f"{1e-4 * max(1.0, r['scale']):.1e}", "same" if r["greedy"] else "DIFFERS",
                          "exact" if r["tp_pp"] else "DIFFERS", f"{r['w8a16']:.1%}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
