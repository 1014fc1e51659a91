"""A fuzz case: one mutated input and one command, made from (seed, index) alone so that any case
can be made and run again by itself (`python -m tests.fuzz --seed S --case K`).

The kind of case K is drawn with KIND_WEIGHTS from random.Random(f"{seed}:{K}"); the kind's
generator (fuzz_files, fuzz_binary, fuzz_templates, fuzz_flags) picks the mutation and the command.
Commands name files as "{W}/part/...": W is the case's own directory, holding a fresh copy of the
base parts it names (fuzz_base.PARTS) with the case's files written over them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

W = "{W}"

# The valid commands the mutated inputs go through (a case may add flags).
COMMANDS: dict[str, list[str]] = {
    "convert_hf": ["convert", "--model_dir", f"{W}/hf", "--output_dir", f"{W}/out"],
    "convert_hf_dry": ["convert", "--model_dir", f"{W}/hf", "--dry_run"],
    "convert_hf_int8": ["convert", "--model_dir", f"{W}/hf", "--output_dir", f"{W}/out", "--use_weight_only"],
    "convert_gguf": ["convert", "--model_dir", f"{W}/model.gguf", "--output_dir", f"{W}/out"],
    "convert_bpe": ["convert", "--model_dir", f"{W}/bpe.gguf", "--output_dir", f"{W}/out"],
    "convert_flm": ["convert", "--model_dir", f"{W}/model.flm", "--output_dir", f"{W}/out"],
    "convert_flm_dry": ["convert", "--model_dir", f"{W}/model.flm", "--dry_run"],
    "build": ["build", "--checkpoint_dir", f"{W}/ckpt", "--output_dir", f"{W}/out", "--max_seq_len", "64"],
    "export": ["export", "--checkpoint_dir", f"{W}/ckpt", "--output_file", f"{W}/out.flm"],
    "export_engine": ["export", "--engine_dir", f"{W}/engine", "--output_file", f"{W}/out.flm"],
    "run_ids": ["run", "--engine_dir", f"{W}/engine", "--input_ids", "1,2,3", "--max_output_len", "3"],
    "run_text": ["run", "--engine_dir", f"{W}/engine", "--input_text", "w1 w2 a", "--max_output_len", "3"],
    "run_chat": ["run", "--engine_dir", f"{W}/engine", "--input_text", "w1 w2", "--max_output_len", "3", "--chat"],
    "run_hf": ["run", "--engine_dir", f"{W}/hf", "--input_text", "w1 w2", "--max_output_len", "2"],
    "eval": ["eval", "--engine_dir", f"{W}/engine", "--text_file", f"{W}/text.txt", "--max_tokens", "24"],
    "inspect_engine": ["inspect", f"{W}/engine"],
    "inspect_ckpt": ["inspect", f"{W}/ckpt"],
    "chat": ["chat", "--engine_dir", f"{W}/engine", "--max_output_len", "3"],
    "serve": ["serve", "--engine_dir", f"{W}/engine", "--port", "0"],
}
CHAT_STDIN = "w1 w2\n/system a b\nw3 a\n/reset\nb c\n/exit\n"
KIND_WEIGHTS = {"safetensors": 14, "config": 16, "tokenizer": 12, "gguf": 14, "flm": 10, "template": 12, "flags": 22}


@dataclass
class Case:
    """One fuzz case: what is mutated how, the files written over the base parts, the command."""

    seed: int
    index: int
    kind: str
    what: str
    argv: list[str]
    files: dict[str, bytes | None] = field(default_factory=dict)  # path under W -> bytes (None: deleted)
    stdin: str = ""
    env: dict[str, str] = field(default_factory=dict)  # values may name {W}
    codes: tuple[int, ...] = (0, 2)  # accepted exit codes of the first step
    budget: float = 30.0  # seconds per step before the case counts as a hang
    after: list[list[str]] = field(default_factory=list)  # steps run while the previous one exits 0

    def steps(self) -> list[list[str]]:
        """The command, then what uses its output (an engine built from a converted checkpoint is run)."""
        return [self.argv, *self.after]

    def parts(self) -> list[str]:
        """The base parts (fuzz_base.PARTS) the case's command and files use."""
        from fuzz_base import PARTS

        text = " ".join([*(a for step in self.steps() for a in step), *self.files, *self.env.values()])
        return [p for p in PARTS if f"{W}/{p}" in text or any(f.split("/")[0] == p for f in self.files)]

    def command(self, workdir: Path, step: int = 0) -> list[str]:
        """Step `step`'s argv with W made the case's directory."""
        return [a.replace(W, str(workdir)) for a in self.steps()[step]]

    def label(self) -> str:
        """One line naming the case for reports and reruns."""
        return f"seed {self.seed} case {self.index} [{self.kind}] {self.what}"


class Base:
    """The base parts' bytes, read once (the generators mutate copies)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, bytes] = {}

    def read(self, rel: str) -> bytes:
        if rel not in self._cache:
            self._cache[rel] = (self.root / rel).read_bytes()
        return self._cache[rel]


def make_case(seed: int, index: int, base: Base, kinds: list[str] | None = None) -> Case:
    """Case `index` of the run seeded `seed` (only of `kinds` when given)."""
    import fuzz_binary
    import fuzz_files
    import fuzz_flags
    import fuzz_templates

    rng = random.Random(f"{seed}:{index}")
    names = kinds or list(KIND_WEIGHTS)
    kind = rng.choices(names, weights=[KIND_WEIGHTS[k] for k in names])[0]
    generators = {"safetensors": fuzz_files.safetensors_case, "config": fuzz_files.config_case,
                  "tokenizer": fuzz_files.tokenizer_case, "gguf": fuzz_binary.gguf_case,
                  "flm": fuzz_binary.flm_case, "template": fuzz_templates.template_case,
                  "flags": fuzz_flags.flags_case}
    case = generators[kind](rng, base)
    case.seed, case.index, case.kind = seed, index, kind
    return case


def new_case(what: str, command: str | list[str], files: dict[str, bytes | None] | None = None,
             **kw) -> Case:
    """A Case (seed, index and kind filled in by make_case) running COMMANDS[command] or an argv."""
    argv = list(COMMANDS[command]) if isinstance(command, str) else command
    if isinstance(command, str) and command == "chat":
        kw.setdefault("stdin", CHAT_STDIN)
    if "--dry_run" in argv:
        kw.setdefault("codes", (0, 1, 2))  # convert --dry_run exits 1 when it flags something
    kw.setdefault("after", follow_ups(argv))
    return Case(seed=0, index=0, kind="", what=what, argv=argv, files=files or {}, **kw)


def _value(argv: list[str], flag: str) -> str | None:
    """The value after the last `flag` in argv (None if absent or last)."""
    where = [i for i, a in enumerate(argv) if a == flag]
    return argv[where[-1] + 1] if where and where[-1] + 1 < len(argv) else None


def follow_ups(argv: list[str]) -> list[list[str]]:
    """What a written output must then do: a checkpoint builds and its engine runs, an engine runs, a
    .flm converts (outputs inside the case's directory only)."""
    out = _value(argv, "--output_dir") or _value(argv, "--output_file")
    if not argv or out is None or not out.startswith(f"{W}/") or "--dry_run" in argv or "--lora_dir" in argv:
        return []
    run = ["run", "--input_ids", "1,2", "--max_output_len", "2", "--engine_dir"]
    if argv[0] == "convert":
        return [["build", "--checkpoint_dir", out, "--output_dir", f"{W}/step_engine"], [*run, f"{W}/step_engine"]]
    if argv[0] == "build":
        return [[*run, out]]
    if argv[0] == "export":
        return [["convert", "--model_dir", out, "--output_dir", f"{W}/step_ckpt"]]
    return []
