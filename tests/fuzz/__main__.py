"""`python -m tests.fuzz`: a seeded fuzz run over every input kind, or chosen cases again, alone.

    python -m tests.fuzz                          # FUZZ_CASES (2000) cases of seed 0: make fuzz
    python -m tests.fuzz --seed 3 --cases 500 --kinds gguf flm
    python -m tests.fuzz --seed 0 --case 17       # case 17 alone, with its commands and full output

Exit code 0 when every case kept the rules (tests/fuzz/fuzz_runner.py), 1 otherwise; the summary
groups failures by cause with one case to rerun each. ROOT (default $TMPDIR/bestiary-fuzz-UID) keeps
the tiny base inputs between runs; --json writes the counts and failures for a report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from fuzz_runner import PROCESS_EVERY, Outcome, Report, run_fuzz

import tests.fuzz  # noqa: F401 - puts this folder and tests/helpers on sys.path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=int(os.environ.get("FUZZ_CASES", "2000")))
    p.add_argument("--case", type=int, nargs="+", default=None, help="Run only these cases (verbose).")
    p.add_argument("--kinds", nargs="+", default=None,
                   choices=["safetensors", "config", "tokenizer", "gguf", "flm", "template", "flags"])
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / f"bestiary-fuzz-{os.getuid()}")
    p.add_argument("--deadline", type=float, default=None, help="Start no case after this many seconds.")
    p.add_argument("--process_every", type=int, default=PROCESS_EVERY,
                   help="Every N-th case also runs as a real `python -m bestiary` process.")
    p.add_argument("--keep", action="store_true", help="Keep the directories of failed cases (ROOT/cases/K).")
    p.add_argument("--json", type=Path, default=None, help="Write the counts and failures here.")
    return p


def _show(outcome: Outcome) -> None:
    """Everything about one case: what it is, each step's command, exit code and output."""
    print(outcome.case.label())
    for step in outcome.steps:
        print(f"  $ bestiary {' '.join(step.argv)}"[:2000] + ("   (as a process)" if step.process else ""))
        print(f"    exit {step.code} in {step.seconds:.2f} s" + (" HANG" if step.hang else "")
              + (f" DIED {step.died}" if step.died is not None else ""))
        for name, text in (("stdout", step.stdout[-2000:]), ("stderr", step.stderr[:6000])):
            if text.strip():
                print(f"    {name}:\n" + "\n".join("      " + line for line in text.rstrip().splitlines()))
    print(f"  => {outcome.failure or 'ok'}")


def _progress(outcome: Outcome) -> None:
    index = outcome.case.index
    if outcome.failure:
        print(f"FAIL {outcome.case.label()}: {outcome.failure}"[:400], flush=True)
        print(f"     $ {outcome.command}"[:400], flush=True)
    elif index % 100 == 99:
        print(f"... {index + 1} cases", flush=True)


def _write_json(path: Path, report: Report) -> None:
    failures = [{"seed": o.case.seed, "case": o.case.index, "kind": o.case.kind, "what": o.case.what[:300],
                 "failure": o.failure, "group": o.group} for o in report.failures()]
    path.write_text(json.dumps({"seed": report.seed, "counts": report.counts(), "failures": failures}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cases = args.case if args.case is not None else args.cases
    verbose = args.case is not None
    report = run_fuzz(args.root, args.seed, cases, kinds=args.kinds, deadline=args.deadline, keep=args.keep or verbose,
                      progress=_show if verbose else _progress, process_every=args.process_every)
    print(report.text())
    if args.json:
        _write_json(args.json, report)
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
