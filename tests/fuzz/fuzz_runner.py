"""Running fuzz cases: the worker process with its watchdog, the rules a run must keep, the report.

A case's directory (ROOT/cases/K) gets fresh copies of the base parts it uses and its mutated files;
each step of the case (fuzz_cases.Case.steps) goes to the worker, which has `budget` seconds to
answer: past that the case is a hang, and the worker is killed (its whole process group) and started
again. Every PROCESS_EVERY-th case also runs its first step as a real `python -m bestiary` process
(the entry path: imports, signal set-up, the interpreter's own exit), in a fresh copy of its directory;
not `serve`, which the worker runs with uvicorn.run stubbed out and which as a process would serve.

The rules (`violation`): no "Traceback" in the output, no "internal error", an exit code the case
accepts (0 or 2; also 1 for `convert --dry_run`, which says so when it flags something), an exit-2
error in one line of stderr (warnings count as lines, and so does a usage block before a parser
error: the CLI's parser errors are one line, core/cli/parsing.py), no hang, the worker alive (a crash, or memory past
its RLIMIT_AS, shows as a death or an exit 1 "out of memory").
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fuzz_cases import Base, Case, W, make_case

HERE = Path(__file__).resolve().parent
PROCESS_EVERY = 25
AS_EXTRA = 3 * 2**29  # address space (1.5 GiB) the worker may grow by after its imports (RLIMIT_AS)


@dataclass
class StepResult:
    """One step of a case: its argv (W replaced), exit code, output, time; hang/died when it never answered."""

    argv: list[str]
    code: int | None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    hang: bool = False
    died: int | None = None  # the worker's exit status when it died
    process: bool = False  # run as a real `python -m bestiary` process


@dataclass
class Outcome:
    """A case and what became of it: the steps run, and the rule broken (None: passed)."""

    case: Case
    steps: list[StepResult] = field(default_factory=list)
    failure: str | None = None
    group: str = ""  # failures grouped by cause
    command: str = ""  # the step that broke a rule, as `bestiary ...` with {W} for the case's directory


def hang_frames(outcome: Outcome, count: int = 8) -> list[str]:
    """The innermost `count` frames of the thread that ran a hung step (faulthandler's "Current thread" block,
    most recent first), or none."""
    hung = [s for s in outcome.steps if s.hang and s.stderr]
    if not hung:
        return []
    block = hung[0].stderr.split("Current thread", 1)[-1].split("\n\n", 1)[0]
    frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File")][:count]
    return [re.sub(r'File "[^"]*/(bestiary|tests|site-packages)/', r'File "\1/', f) for f in frames]


def error_lines(stderr: str) -> list[str]:
    """stderr's non-empty lines (warnings and usage blocks count as lines)."""
    return [line for line in stderr.splitlines() if line.strip()]


def violation(step: StepResult, codes: tuple[int, ...]) -> str | None:
    """The rule `step` broke, or None."""
    where = " (process)" if step.process else ""
    if step.hang:
        return f"hang{where}"
    if step.died is not None:
        return f"crash: the worker died (status {step.died})"
    if "Traceback" in step.stderr or "Traceback" in step.stdout:
        return f"traceback{where}"
    if "internal error" in step.stderr:
        return f"internal error{where}"
    if step.code not in codes:
        return f"exit {step.code}{where}"
    if step.code == 2 and len(error_lines(step.stderr)) > 1:
        return f"multi-line error{where}"
    return None


def _normal(text: str, workdir: Path) -> str:
    """A message with the case's paths, numbers and quoted values blurred (to group failures)."""
    text = text.replace(str(workdir), "W")
    text = re.sub(r"'[^']{25,}'|\"[^\"]{25,}\"", "'…'", text)
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", text)[:110]


def group_of(failure: str, step: StepResult, workdir: Path) -> str:
    """The cause a failure is grouped under: the rule, the command, and the telling line of stderr."""
    lines = [line for line in step.stderr.splitlines() if line.strip()]
    telling = next((line for line in lines if "internal error" in line), None)
    if telling is None and "Traceback" in step.stderr:
        telling = next((line for line in reversed(lines) if not line.startswith(" ")), "")
    if telling is None:  # a multi-line error: its first and last lines
        telling = " | ".join(lines[:1] + lines[1:][-1:])
    command = step.argv[0] if step.argv else "?"
    return f"{failure}: {command}: {_normal(telling, workdir)}"


class Worker:
    """The worker process (fuzz_worker.py) and the pipe its replies come on."""

    def __init__(self, root: Path, env: dict[str, str], log: Path) -> None:
        self.root, self.env, self.log = root, env, log
        self.proc: subprocess.Popen | None = None
        self.as_limit = 0

    def start(self, timeout: float = 900.0) -> None:
        read_fd, write_fd = os.pipe()
        request_read, request_write = os.pipe()
        with open(self.log, "ab") as log:
            argv = [sys.executable, str(HERE / "fuzz_worker.py"), str(self.root), str(request_read), str(write_fd),
                    str(AS_EXTRA)]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         pass_fds=(request_read, write_fd), env=self.env, start_new_session=True)
        os.close(write_fd)
        os.close(request_read)
        self.replies = os.fdopen(read_fd, "r")
        self.requests = os.fdopen(request_write, "w")
        ready = self._reply(timeout)
        if not ready or not ready.get("ready"):
            self.stop()
            tail = self.log.read_text(errors="replace").splitlines()[-5:]
            raise RuntimeError(f"the fuzz worker did not start (log {self.log}):\n" + "\n".join(tail))
        self.as_limit = ready["as_limit"]

    def _reply(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.replies], [], [], timeout)
        if not ready:
            return None
        line = self.replies.readline()
        return json.loads(line) if line else {}

    def run(self, argv: list[str], cwd: Path, stdin: str, env: dict[str, str], budget: float) -> StepResult:
        """One step in the worker; a hang or a death restarts it."""
        if self.proc is None:
            self.start()
        assert self.proc is not None
        request = {"argv": argv, "cwd": str(cwd), "stdin": stdin, "env": env}
        logged = self.log.stat().st_size if self.log.exists() else 0
        try:
            self.requests.write(json.dumps(request) + "\n")
            self.requests.flush()
            reply = self._reply(budget)
        except BrokenPipeError:
            reply = {}
        if reply:
            return StepResult(argv, reply["code"], reply["stdout"], reply["stderr"], reply["seconds"])
        status = self.proc.poll()
        stacks = self.stacks(logged) if reply is None else ""
        self.stop()
        if reply is None:
            return StepResult(argv, None, stderr=stacks, seconds=budget, hang=True)
        return StepResult(argv, None, died=status)

    def stacks(self, logged: int) -> str:
        """Where a hung worker is: its threads' Python stacks (faulthandler on SIGUSR1, fuzz_worker.main), as
        the log has them after `logged` bytes."""
        assert self.proc is not None
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        time.sleep(1.0)
        with open(self.log, "rb") as f:
            f.seek(logged)
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        """Kill the worker and everything it started."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.replies.close()
            try:
                self.requests.close()
            except BrokenPipeError:
                pass
            self.proc = None


def prepare(case: Case, base: Path, workdir: Path) -> None:
    """workdir: fresh copies of the case's base parts, its files written over them."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for part in case.parts():
        if (base / part).is_dir():
            shutil.copytree(base / part, workdir / part)
        else:
            shutil.copy2(base / part, workdir / part)
    for rel, data in case.files.items():
        target = workdir / rel
        if data is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def run_process(case: Case, workdir: Path, env: dict[str, str], as_limit: int) -> StepResult:
    """The case's first step as `python -m bestiary ...` (RLIMIT_AS as the worker's)."""
    import resource

    argv = case.command(workdir)
    step_env = {**env, **{k: v.replace(W, str(workdir)) for k, v in case.env.items()}}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "bestiary", *argv], input=case.stdin, capture_output=True,
                              text=True, errors="replace", cwd=workdir, env=step_env, timeout=case.budget + 30,
                              preexec_fn=limit, check=False, start_new_session=True)
    except subprocess.TimeoutExpired:
        return StepResult(argv, None, seconds=case.budget + 30, hang=True, process=True)
    except ValueError as err:  # argv the OS cannot take (an embedded NUL): not a case for a process
        return StepResult(argv, 0, stderr=f"(not run as a process: {err})", process=True)
    return StepResult(argv, proc.returncode, proc.stdout[-4000:], proc.stderr[:20000], time.perf_counter() - start,
                      process=True)


@dataclass
class Report:
    """What a fuzz run did: every outcome, the cases left for lack of time, the seconds taken."""

    seed: int
    planned: int
    outcomes: list[Outcome] = field(default_factory=list)
    not_run: int = 0
    seconds: float = 0.0
    kinds: list[str] | None = None

    def rerun(self, case: Case) -> str:
        """The command that runs `case` again, alone."""
        kinds = f" --kinds {' '.join(self.kinds)}" if self.kinds else ""
        return f"python -m tests.fuzz --seed {case.seed} --case {case.index}{kinds}"

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failure]

    def ok(self) -> bool:
        return not self.failures() and not self.not_run

    def counts(self) -> dict[str, int]:
        """Cases, steps and processes run, and failures by rule (the figures `make fuzz` prints)."""
        steps = [s for o in self.outcomes for s in o.steps]
        rules = Counter((o.failure or "").split(" (")[0].split(":")[0] for o in self.failures())
        return {"cases": len(self.outcomes), "steps": len(steps), "processes": sum(s.process for s in steps),
                "failures": len(self.failures()), "internal errors": rules["internal error"],
                "tracebacks": rules["traceback"], "multi-line errors": rules["multi-line error"],
                "hangs": rules["hang"], "crashes": rules["crash"],
                "other exit codes": sum(n for r, n in rules.items() if r.startswith("exit")),
                "not run (time)": self.not_run}

    def text(self, limit: int = 40) -> str:
        """The summary: counts, exit codes, kinds, then each failure group with one case to rerun."""
        steps = [s for o in self.outcomes for s in o.steps]
        lines = [f"fuzz: seed {self.seed}: {len(self.outcomes)} of {self.planned} cases in {self.seconds:.0f} s",
                 "  " + ", ".join(f"{k} {v}" for k, v in self.counts().items()),
                 "  exit codes: " + ", ".join(f"{c}: {n}" for c, n in sorted(Counter(
                     str(s.code) for s in steps).items())),
                 "  kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(Counter(
                     o.case.kind for o in self.outcomes).items()))]
        groups: dict[str, list[Outcome]] = {}
        for o in self.failures():
            groups.setdefault(o.group, []).append(o)
        for group, members in sorted(groups.items(), key=lambda g: -len(g[1]))[:limit]:
            first = members[0].case
            lines += [f"  [{len(members)}] {group}", f"      e.g. {first.label()}"[:300],
                      f"      $ {members[0].command}"[:300], f"      rerun: {self.rerun(first)}"]
            lines += [f"      hung in: {frame}"[:300] for frame in hang_frames(members[0])]
        notes = Counter(o.group for o in self.outcomes if not o.failure and o.group)
        lines += [f"  note [{n}] {g}" for g, n in notes.most_common(10)]
        return "\n".join(lines)


def worker_env(root: Path) -> dict[str, str]:
    """The worker's environment: offline, one thread, its own cache (ROOT/cache; the user's CPU
    kernels copied in when built), no debug re-raise."""
    from bestiary.core.format.cache import cache_dir

    env = {k: v for k, v in os.environ.items() if k not in ("BESTIARY_DEBUG", "PYTHONWARNINGS")}
    env.update(FUZZ_USER_CACHE=str(cache_dir()), BESTIARY_CACHE=str(root / "cache"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2",
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE.parent / "helpers"), env.get("PYTHONPATH", "")) if p))
    return env


@dataclass
class Run:
    """What run_case needs besides the case: the worker, where things are, the options."""

    worker: Worker
    base: Path
    cases_dir: Path
    env: dict[str, str]
    keep: bool = False


def run_case(case: Case, run: Run, process: bool = False) -> Outcome:
    """Every step of `case` in the worker (then the first as a process when asked), checked."""
    workdir = run.cases_dir / str(case.index)
    prepare(case, run.base, workdir)
    outcome = Outcome(case)
    env = {k: v.replace(W, str(workdir)) for k, v in case.env.items()}
    for i in range(len(case.steps())):
        step = run.worker.run(case.command(workdir, i), workdir, case.stdin if i == 0 else "", env, case.budget)
        outcome.steps.append(step)
        _judge(outcome, step, case.codes if i == 0 else (0, 2), workdir)
        if outcome.failure or step.code != 0:
            if i and step.code == 2 and not outcome.failure:
                outcome.group = f"step {i} refused what step 0 wrote: {group_of('', step, workdir)}"
            break
    if process and not outcome.failure and case.argv[:1] != ["serve"]:  # a real `serve` would serve
        prepare(case, run.base, workdir)
        step = run_process(case, workdir, run.env, run.worker.as_limit)
        outcome.steps.append(step)
        _judge(outcome, step, case.codes, workdir)
    if not (run.keep and outcome.failure):
        shutil.rmtree(workdir, ignore_errors=True)
    return outcome


def _judge(outcome: Outcome, step: StepResult, codes: tuple[int, ...], workdir: Path) -> None:
    failure = violation(step, codes)
    if failure and not outcome.failure:
        outcome.failure, outcome.group = failure, group_of(failure, step, workdir)
        argv = " ".join(step.argv).replace(str(workdir), W)
        outcome.command = f"{'python -m ' if step.process else ''}bestiary {argv}"


def run_fuzz(root: Path, seed: int, cases: int | list[int], kinds: list[str] | None = None,
             deadline: float | None = None, keep: bool = False,
             progress=None, process_every: int = PROCESS_EVERY) -> Report:
    """Run cases 0..cases-1 (or the listed ones) of `seed` under ROOT, every `process_every`-th also
    as a process; stop starting cases after `deadline` seconds (the rest count as not run)."""
    root.mkdir(parents=True, exist_ok=True)
    indices = list(range(cases)) if isinstance(cases, int) else list(cases)
    report = Report(seed, len(indices), kinds=kinds)
    env = worker_env(root)
    worker = Worker(root, env, root / "worker.log")
    start = time.perf_counter()
    worker.start()
    run = Run(worker, root / "base", root / "cases", env, keep)
    try:
        base = Base(run.base)
        for n, k in enumerate(indices):
            if deadline is not None and time.perf_counter() - start > deadline:
                report.not_run = len(indices) - n
                break
            outcome = run_case(make_case(seed, k, base, kinds), run, process=k % process_every == process_every - 1)
            report.outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
    finally:
        worker.stop()
        report.seconds = time.perf_counter() - start
    return report
