"""How long `make test-slow` takes on its two workers for a given file order: a replay of pytest-xdist's
`--dist loadfile --no-loadscope-reorder` hand-out with measured test durations.

The hand-out replayed (xdist's LoadScopeScheduling): each worker gets the next file in order; a worker
with at most 2 tests left gets one more; a worker's tests run one after another. Durations come from a
log of `pytest -m slow --durations=0` (setup + call + teardown of each test; 0.5 s for a test not in it);
the order is tests/conftest.py's (FIRST, then collection order), or with --only_first N the first N files
of FIRST and the rest in collection order (what the order gains). Prints each worker's end, in seconds.

    pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m slow --durations=0 tests > slow.log
    python benchmarks/slow_suite_schedule.py slow.log [--only_first 2] [--set TEST_ID=SECONDS ...]

The figures in tests/conftest.py (FIRST): the log of 2026-12-01 with the FP8 gate at the 50 s it takes
since the five calibrated gates share one run (--set '...within_gate[FP8]=50'), all of FIRST, then --only_first 2.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

REPORT = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+)")
UNTIMED = 0.5  # seconds for a test the log does not list (xdist's report leaves out the shortest)


def durations(log: str) -> dict[str, float]:
    """Test id -> its seconds (setup + call + teardown) in a --durations=0 report."""
    out: dict[str, float] = collections.defaultdict(float)
    with open(log) as f:
        for line in f:
            m = REPORT.match(line)
            if m:
                out[m.group(2)] += float(m.group(1))
    return out


def collected() -> list[str]:
    """The slow tests' ids in collection order: files by path (pytest walks the folders in name order; the FIRST
    sort of tests/conftest.py undone), each file's tests in its own order."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "slow", "tests"],
                         capture_output=True, text=True, check=False)
    ids = [line.strip() for line in run.stdout.splitlines() if "::" in line]
    return sorted(ids, key=lambda i: i.split("::")[0])  # stable: a file's tests keep their order


def replay(ids: list[str], seconds: dict[str, float], first: tuple[str, ...]) -> list[float]:
    """Each worker's end (s) when files are handed out in `first`'s order, then in the order of `ids`."""
    ordered = sorted(ids, key=lambda i: next((n for n, f in enumerate(first) if i.startswith(f)), len(first)))
    queue: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
    for i in ordered:
        queue.setdefault(i.split("::")[0], []).append(i)
    pending: list[list[str]] = [[], []]
    ends = [0.0, 0.0]

    def hand_out(w: int) -> None:
        if queue and len(pending[w]) <= 2:
            pending[w].extend(queue.popitem(last=False)[1])

    for w in (0, 1):  # a file each, then a second one to a worker with at most 2 tests
        if queue:
            pending[w].extend(queue.popitem(last=False)[1])
    for w in (0, 1):
        hand_out(w)
    while pending[0] or pending[1]:
        w = min((x for x in (0, 1) if pending[x]), key=lambda x: ends[x] + seconds.get(pending[x][0], UNTIMED))
        ends[w] += seconds.get(pending[w].pop(0), UNTIMED)
        hand_out(w)
    return ends


def main() -> None:
    sys.path.insert(0, "tests")
    from conftest import FIRST

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="output of pytest -m slow --durations=0")
    parser.add_argument("--only_first", type=int, default=None,
                        help="name only the first N files of FIRST (default: all of them)")
    parser.add_argument("--set", action="append", default=[], metavar="TEST_ID=SECONDS",
                        help="replay a test at these seconds instead of the log's, e.g. one a change made faster "
                             "(repeatable; default: none)")
    args = parser.parse_args()
    first = FIRST if args.only_first is None else FIRST[: args.only_first]
    seconds = durations(args.log)
    for item in args.set:
        test, _, value = item.rpartition("=")
        if not test or test not in seconds:
            parser.error(f"--set {item}: expected TEST_ID=SECONDS with a test id the log lists")
        seconds[test] = float(value)
    ends = replay(collected(), seconds, first)
    print(f"{len(first)} files first: workers end at {ends[0]:.0f} s and {ends[1]:.0f} s; the stage: {max(ends):.0f} s")


if __name__ == "__main__":
    main()
