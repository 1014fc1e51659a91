"""The fuzzer as a test: seeded cases of every input kind (safetensors, config.json, tokenizer files,
GGUF, .flm, chat templates, CLI flags) through the CLI, none of which may end in a traceback, an
"internal error", an exit code other than 0 or 2, an exit-2 error of more than one line, a hang or a
crash (rules: tests/fuzz/fuzz_runner.py). A failure names the seed and case to rerun alone:
`python -m tests.fuzz --seed S --case K`. `make fuzz` runs FUZZ_CASES (2000) of them.

The fast run stops starting cases after FAST_DEADLINE_S (so `make test` stays bounded on a busy
machine) but must get through FAST_MIN_CASES; the slow one runs SLOW_CASES of another seed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from fuzz_cases import Base, make_case  # noqa: E402
from fuzz_runner import StepResult, run_fuzz, violation  # noqa: E402

FAST_SEED, FAST_CASES, FAST_DEADLINE_S, FAST_MIN_CASES, FAST_PROCESS_EVERY = 46, 200, 70.0, 80, 50
SLOW_SEED, SLOW_CASES, SLOW_DEADLINE_S = 1046, 500, 170.0


def test_fuzz_every_input_kind(tmp_path):
    report = run_fuzz(tmp_path, FAST_SEED, FAST_CASES, deadline=FAST_DEADLINE_S, process_every=FAST_PROCESS_EVERY)
    print(report.text())
    assert not report.failures(), report.text()
    assert len(report.outcomes) >= FAST_MIN_CASES, report.text()
    assert len({o.case.kind for o in report.outcomes}) == 7, report.text()
    base = Base(tmp_path / "base")
    for outcome in report.outcomes[:20]:  # a case is made from (seed, index) alone: a rerun is the same case
        again = make_case(FAST_SEED, outcome.case.index, base)
        assert (again.what, again.argv, again.files) == (outcome.case.what, outcome.case.argv, outcome.case.files)


USAGE = ("usage: bestiary run [-h] --engine_dir ENGINE_DIR\n       [--top_k TOP_K]\n"
         "bestiary run: error: argument --top_k: x\n")


@pytest.mark.parametrize("step, broken", [
    (StepResult(["run"], 2, stderr="error: --top_k: expected an integer\n"), None),
    (StepResult(["run"], 0, stdout="w1 w2\n", stderr="[bestiary] 2 prompt tokens\n"), None),
    (StepResult(["run"], 2, stderr=USAGE), "multi-line error"),  # a usage block counts: parser errors are 1 line
    (StepResult(["run"], 2, stderr="x.py:3: RuntimeWarning: overflow\nerror: bad\n"), "multi-line error"),
    (StepResult(["run"], 1, stderr="internal error: TypeError: x (rerun with BESTIARY_DEBUG=1)\n"), "internal error"),
    (StepResult(["run"], 2, stderr="Traceback (most recent call last):\n  File ...\nKeyError: 1\n"), "traceback"),
    (StepResult(["run"], 1, stderr="error: out of memory\n"), "exit 1"),
    (StepResult(["run"], 130, stderr="interrupted\n"), "exit 130"),
    (StepResult(["run"], None, hang=True), "hang"),
    (StepResult(["run"], None, died=-11), "crash: the worker died (status -11)"),
])
def test_the_rules_a_case_must_keep(step, broken):
    assert violation(step, (0, 2)) == broken


def test_flag_kinds_follow_the_parser():
    """Path flags have a type now (core.cli.parsing.path_arg): they are still fuzzed as paths, not ints."""
    from fuzz_flags import _host_sized, flag_table

    build = {f.option or f.name: f.kind for f in flag_table()["build"]}
    run = {f.option or f.name: f.kind for f in flag_table()["run"]}
    inspect = {f.option or f.name: f.kind for f in flag_table()["inspect"]}
    assert (build["--output_dir"], build["--checkpoint_dir"], build["--max_batch_size"]) == ("output", "input", "int")
    assert (run["--lora_dir"], run["--num_threads"], inspect["directory"]) == ("input", "int", "input")
    assert _host_sized("build", {"--max_tokens_in_paged_kv_cache": ["1000000000"]})  # this host may not hold it
    assert not _host_sized("build", {"--max_tokens_in_paged_kv_cache": ["2147483648"]})  # a mistake: exit 2
    assert not _host_sized("run", {"--max_batch_size": ["1000000000"]})


@pytest.mark.slow
def test_fuzz_larger_run(tmp_path):
    report = run_fuzz(tmp_path, SLOW_SEED, SLOW_CASES, deadline=SLOW_DEADLINE_S)
    print(report.text())
    assert not report.failures(), report.text()
    assert len(report.outcomes) >= SLOW_CASES // 2, report.text()


def test_a_hang_reports_where_it_hung():
    """A hung step carries the worker's stacks (faulthandler on SIGUSR1 before the kill); the report shows the
    innermost frames of the thread that ran it, paths from the package on (CI's unexplained 30 s hang of one
    `convert --fp8 --fp8_kv_cache` case said only "hang")."""
    from fuzz_runner import Outcome, StepResult, hang_frames

    stacks = ('Thread 0x00007f01 (most recent call first):\n  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
              '\nCurrent thread 0x00007f00 (most recent call first):\n'
              '  File "/x/build/bestiary/core/convert/calibration.py", line 88 in collect\n'
              '  File "/x/tests/fuzz/fuzz_worker.py", line 82 in run_case\n\n')
    hung = Outcome(case=None, steps=[StepResult(["convert"], None, stderr=stacks, seconds=30.0, hang=True)])
    assert hang_frames(hung) == ['File "bestiary/core/convert/calibration.py", line 88 in collect',
                                 'File "tests/fuzz/fuzz_worker.py", line 82 in run_case']
    assert hang_frames(Outcome(case=None, steps=[StepResult(["run"], 0)])) == []
