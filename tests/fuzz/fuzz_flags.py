"""Fuzz cases of the command line: every command's flags, read from the CLI's own parser (so a new
flag is fuzzed without a change here), given hostile values by their kind: integers (negative, zero,
huge, not integers), floats (NaN, inf, huge, text), choices (unknown ones), text (empty, huge, not
UTF-8, control characters) and paths (a file where a dir is wanted and the other way round, missing,
under a file, unwritable, devices, the user's own files as outputs). Paths that are written stay
inside the case's directory or are unwritable (/proc, /sys): the fuzzer never aims a write at the
machine's own files."""

from __future__ import annotations

import argparse
import functools
import random
from dataclasses import dataclass

from fuzz_cases import COMMANDS, Base, Case, W, new_case

INTS = ["-1", "0", "1", "2", "3", "7", "1000000000", "2147483648", "9223372036854775808", "10**9", "1e3", "1.5", "x",
        "", " 5", "\u0663", "0x10", "+5", "1_000", "-2147483649", "99999999999999999999999"]
SMALL_INTS = ["-1", "0", "1", "2", "x", "", "1.5", "\u0663"]  # flags where a huge value is real work, not a mistake
FLOATS = ["nan", "inf", "-inf", "-1", "0", "1e308", "-1e308", "1e-320", "x", "", "1.5", "-0", "2", "0.5", "1e400"]
TEXTS = ["", " ", "w1", "a b c", "x" * 100000, "\udcff\udcfe", "\u202e\u0000", "\n\n", "a,b", "1,2,3", "-1", "0",
         "999999999,1", "1,,2", "{{ x }}", "w1 " * 5000, "\x1b[31mred", "%s%n", "--help"]
OUTPUT_PATHS = [f"{W}/out", f"{W}/text.txt", f"{W}/hf", f"{W}/engine", f"{W}/ckpt", f"{W}/text.txt/sub",
                f"{W}/missing/deeper/out", "", ".", f"{W}/" + "a" * 300, f"{W}/\udcff", "/proc/bestiary-fuzz/out",
                "/sys/bestiary-fuzz", f"{W}/model.flm", f"{W}/out.flm", f"{W}/.", f"{W}/hf/config.json"]
INPUT_PATHS = [f"{W}/hf", f"{W}/ckpt", f"{W}/engine", f"{W}/text.txt", f"{W}/model.gguf", f"{W}/model.flm",
               f"{W}/missing", "", "/", "/dev/null", "/dev/zero", "/proc/self/mem", f"{W}/text.txt/sub", f"{W}/\udcff",
               f"{W}/" + "a" * 300, f"{W}/hf/config.json", f"{W}/template.jinja", "-"]
DEVICES = ["cpu", "cuda", "cuda:0", "cuda:99", "cpu:1", "mps", "", "meta", "tpu", "cuda:-1", "CPU", "cuda:x"]
OUTPUT_FLAGS = {"output_dir", "output_file", "report", "workdir"}
KV_POOL_FLAGS = {"--max_batch_size", "--max_seq_len", "--max_tokens_in_paged_kv_cache", "--tokens_per_block"}
HOST_SIZED, INT32_MAX = 10**6, 2**31 - 1  # a pool of a million tokens and more may be more than this host holds
INPUT_FLAGS = {"model_dir", "checkpoint_dir", "engine_dir", "text_file", "lora_dir", "calib_text", "chat_template",
               "draft_engine_dir", "hf_model", "gguf", "directory"}
SMALL_ONLY = {"tune_steps", "repeats", "rounds", "mixed_requests", "rewrite_texts", "static_batch", "bandwidth_mib",
              "max_queue_len"}
EXTRA_BASE: dict[str, list[str]] = {
    "list": ["list"], "cache": ["cache", "list"], "demo": ["demo"],
    "bench": ["bench", "--engine_dir", f"{W}/engine", "--workloads", "decode", "--new_tokens", "2", "--repeats", "1",
              "--decode_prompt_len", "4", "--bandwidth_mib", "0"],
}
BASES = {"convert": ["convert_hf", "convert_gguf", "convert_flm"], "build": ["build"], "export": ["export"],
         "run": ["run_ids", "run_text", "run_chat"], "eval": ["eval"], "inspect": ["inspect_engine", "inspect_ckpt"],
         "chat": ["chat"], "serve": ["serve"]}
COMMAND_WEIGHTS = {"run": 24, "convert": 20, "build": 14, "export": 7, "eval": 6, "chat": 6, "serve": 6, "bench": 5,
                   "inspect": 3, "cache": 3, "list": 1, "demo": 5}


@dataclass(frozen=True)
class Flag:
    """One flag of a command, as its parser declares it."""

    name: str  # without dashes; a positional's dest
    option: str  # "--name", or "" for a positional
    kind: str  # switch, choice, int, float, text, input, output, device
    nargs: object
    choices: tuple


def _kind(action: argparse.Action) -> str:
    name = action.dest
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return "choice"
    if name in OUTPUT_FLAGS:  # path flags have a type (core.cli.parsing.path_arg): named before the ints
        return "output"
    if name in INPUT_FLAGS or getattr(action.type, "__name__", "") == "path":
        return "input"
    if action.type is float:
        return "float"
    if action.type is not None:
        return "int"
    return "device" if name == "device" else "text"


@functools.lru_cache(maxsize=1)
def flag_table() -> dict[str, list[Flag]]:
    """Every command's flags, from `bestiary`'s parser."""
    from bestiary.core.cli.main import make_parser

    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: [Flag(a.dest, a.option_strings[0] if a.option_strings else "", _kind(a), a.nargs,
                        tuple(a.choices or ()))
                   for a in parser._actions if a.dest != "help"]
            for name, parser in sub.choices.items()}


def hostile_values(rng: random.Random, flag: Flag, command: str) -> tuple[list[str], bool]:
    """Values for `flag` (one unless nargs asks for more), and whether argparse must refuse them (so the
    command never starts: used by `demo`, which would otherwise convert the real SmolLM2)."""
    pools = {"int": SMALL_INTS if flag.name in SMALL_ONLY else INTS, "float": FLOATS, "text": TEXTS,
             "output": OUTPUT_PATHS, "input": INPUT_PATHS, "device": DEVICES,
             "choice": [*map(str, flag.choices), "x", "", str(flag.choices[0]).upper() if flag.choices else "X"]}
    if flag.kind == "switch":
        return [], False
    pool = pools[flag.kind]
    if flag.nargs == "+":
        return [rng.choice(pool) for _ in range(rng.choice([1, 1, 2, 3]))], False
    if flag.nargs == 2:
        return [rng.choice(pool), rng.choice(pool)], False
    value = rng.choice(pool)
    return [value], flag.kind == "choice" and value not in map(str, flag.choices)


def _split(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """A base argv -> (command and positionals, {--flag: values})."""
    head, flags, current = [], {}, None
    for arg in argv:
        if arg.startswith("--"):
            current = arg
            flags[current] = []
        elif current is None:
            head.append(arg)
        else:
            flags[current].append(arg)
    return head, flags


def _host_sized(command: str, given: dict[str, list[str]]) -> bool:
    """`build` given a KV pool flag of a large count the engine can hold (HOST_SIZED): this host's
    memory may refuse the pool (exit 1); a count past INT32_MAX is refused as a mistake (exit 2)."""
    if command != "build":
        return False
    for option in KV_POOL_FLAGS & given.keys():
        try:
            value = int(given[option][0])
        except (ValueError, IndexError):
            continue
        if HOST_SIZED <= value <= INT32_MAX:
            return True
    return False


def flags_case(rng: random.Random, base: Base) -> Case:
    """One command with 1-3 of its flags (or its positional) given hostile values."""
    command = rng.choices(list(COMMAND_WEIGHTS), weights=list(COMMAND_WEIGHTS.values()))[0]
    name = rng.choice(BASES[command]) if command in BASES else command
    head, given = _split(list(COMMANDS[name]) if command in BASES else list(EXTRA_BASE[command]))
    table = flag_table()[command]
    if command == "demo":
        table = [f for f in table if f.kind in ("int", "choice")]
    edits = []
    for flag in rng.sample(table, min(len(table), rng.choice([1, 1, 2, 3]))) if table else []:
        values, refused = hostile_values(rng, flag, command)
        if command == "demo" and flag.kind == "int":
            values = [rng.choice(["-1", "0", "x", "", "1.5", "10**9"])]  # refused by argparse: demo never starts
        elif command == "demo" and not refused:
            values = ["x"]  # a valid --dtype would start the demo (a convert of the real SmolLM2)
        if not flag.option:
            slot = 1 + [f.name for f in table if not f.option].index(flag.name)
            if slot < len(head):
                head[slot] = values[0]
            else:  # an optional positional the base leaves out (MODEL of run / chat / eval / serve)
                head.append(values[0])
        else:
            given[flag.option] = values
        edits.append(f"{flag.option or '<' + flag.name + '>'} {' '.join(v[:40] for v in values)}".rstrip())
    argv = head + [x for option, values in given.items() for x in (option, *values)]
    env = {"BESTIARY_CACHE": f"{W}/cache"} if command == "cache" else {}
    # An output on a filesystem that cannot be written (/proc, /sys), or a KV pool this host cannot hold,
    # is the machine's fault in core/cli/failures.py's table (EnvironmentFault, exit 1); a file in the
    # way, or a pool past the engine's 32-bit counts, is the user's (exit 2).
    host = "--dry_run" in argv or any(a.startswith(("/proc/", "/sys/")) for a in argv) or _host_sized(command, given)
    codes = (0, 1, 2) if host else (0, 2)
    return new_case(f"{name}: {'; '.join(edits) or 'as is'}", argv, env=env, codes=codes,
                    budget=60.0 if command == "demo" else 30.0)
