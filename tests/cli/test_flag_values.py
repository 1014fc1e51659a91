"""Issue 46, the fuzzer's flag cases: every mistake in a flag is one line on stderr and exit code 2,
read where the value is read (the parser's types, BuildConfig, SamplingConfig, the output checks).

Each test reproduces a fuzz case (seed/case in its docstring): `--num_threads 2**63` overflowed
torch (internal error), `--temperature 1e-320` sampled from NaN, `--bad_words " "` indexed an empty
id list, a note came before a later error (two lines), limits past 32-bit counts and the user's own
paths (a name too long, an output under a file) were exit 1, and argparse printed a usage block.
`--max_attention_window 2**63` and `--random_seed 10**23` overflowed torch too (found alongside)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.cli.main import main, make_parser  # noqa: E402
from bestiary.core.cli.parsing import OneLineParser, int_range, path_arg  # noqa: E402
from bestiary.core.format.build_config import INT32_MAX  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.format.output_dir import TEMP_ROOM, check_output_dir, check_output_file  # noqa: E402
from bestiary.core.format.path_limits import file_in_the_way, path_problem  # noqa: E402
from bestiary.core.runtime.sampling import MIN_TEMPERATURE, SamplingConfig  # noqa: E402

LONG = "a" * 300  # a name past NAME_MAX (255 bytes)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("flags"), tokenizer=True)


def parser_error(capsys, argv: list[str], *words: str) -> str:
    """`bestiary argv` must stop in the parser: exit 2, one line `PROG: error: ... (see PROG --help)`."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.endswith("--help)\n") and "usage:" not in err, err
    for word in words:
        assert word in err, err
    return err


def run(tiny: Path, *extra: str) -> list[str]:
    return ["run", "--engine_dir", str(tiny / "engine"), "--input_ids", "1,2,3", "--max_output_len", "3", *extra]


def build(tiny: Path, out: Path | str, *extra: str) -> list[str]:
    return ["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(out), *extra]


# --- item 4: a parser error is one line ------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    ([], ["bestiary: error: the following arguments are required: COMMAND (see bestiary --help)"]),
    (["nosuch"], ["bestiary: error: argument COMMAND: invalid choice: 'nosuch'"]),
    (["build", "--max_seq_len", "x"], ["bestiary build: error: argument --max_seq_len: invalid positive_int value: "
                                       "'x' (see bestiary build --help)"]),
    (["build"], ["the following arguments are required: --checkpoint_dir, --output_dir"]),
    (["run", "--engine_dir", "e", "--input_ids", "1", "--early_stopping", "x"], ["argument --early_stopping: "
                                                                                "invalid choice: 'x'"]),
    (["run", "--engine_dir", "e", "--input_ids", "1", "--no_such_flag"], ["unrecognized arguments: --no_such_flag"]),
    (["export", "--engine_dir", "e", "--checkpoint_dir", "c", "--output_file", "o"], ["not allowed with argument"]),
    (["cache", "x"], ["bestiary cache: error: argument action: invalid choice: 'x'"]),
    (["chat", "--engine_dir", "e", "--top_k", "1.5"], ["argument --top_k: invalid int value: '1.5'"]),
])
def test_every_parser_error_is_one_line(capsys, argv, words):
    """seed 0: 109 exit-2 cases printed argparse's usage block before their `error:` line."""
    parser_error(capsys, argv, *words)


def test_help_is_argparses_own(capsys):
    """--help prints the usage and the flags as before, exit 0."""
    for argv, head in (([], "usage: bestiary [-h] [--version]"), (["build"], "usage: bestiary build [-h]")):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert stop.value.code == 0 and out.startswith(head), out
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert all(isinstance(p, OneLineParser) for p in sub.choices.values())
    plain = argparse.ArgumentParser(prog="x")
    ours = OneLineParser(prog="x")
    for p in (plain, ours):
        p.add_argument("--n", type=int_range(1), help="N.")
    assert ours.format_help() == plain.format_help()


# --- item 1: flag values ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "eval", "chat", "serve", "bench", "demo"])
def test_num_threads_past_the_limit_is_a_parser_error(capsys, command):
    """seed 0 case 732: `eval --num_threads 9223372036854775808` overflowed torch.set_num_threads."""
    parser_error(capsys, [command, "--num_threads", "9223372036854775808"], f"bestiary {command}: error: "
                 "argument --num_threads: '9223372036854775808': expected at most 1,024 threads")


@pytest.mark.parametrize("flags, words", [
    (["--max_attention_window", str(2**63)], "argument --max_attention_window: '9223372036854775808': expected at most "
                                             "2,147,483,647"),
    (["--max_output_len", "99999999999999999999999"], "argument --max_output_len"),
    (["--num_beams", str(2**31)], "argument --num_beams"),
    (["--sink_token_length", "-1"], "argument --sink_token_length: '-1': expected an integer >= 0"),
])
def test_counts_past_32_bits_are_parser_errors(tiny, capsys, flags, words):
    """`run --max_attention_window 2**63` was an internal error (an overflow in torch)."""
    parser_error(capsys, run(tiny, *flags), words)


def test_a_subnormal_temperature_is_refused(tiny, capsys):
    """seed 1 case 304: `--temperature 1e-320` gave "probability tensor contains inf/nan" (exit 1)."""
    one_line(capsys, run(tiny, "--temperature", "1e-320"), 2, "field 'temperature'",
             f"expected 0 (greedy) or at least {MIN_TEMPERATURE}", "(got 1e-320)")
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=MIN_TEMPERATURE / 2)
    assert SamplingConfig(temperature=0.0).is_greedy and not SamplingConfig(temperature=MIN_TEMPERATURE).is_greedy
    assert main(run(tiny, "--temperature", str(MIN_TEMPERATURE), "--random_seed", "1")) == 0  # samples, finite


def test_a_seed_past_64_bits_is_refused(tiny, capsys):
    """`run --random_seed 99999999999999999999999` overflowed torch's manual_seed (internal error)."""
    one_line(capsys, run(tiny, "--temperature", "1", "--random_seed", "99999999999999999999999"), 2,
             "field 'random_seed'", "less than or equal to 9223372036854775807")
    for seed in (str(2**63 - 1), "-1"):
        assert main(run(tiny, "--temperature", "1", "--random_seed", seed)) == 0


@pytest.mark.parametrize("words", [[" "], ["\n\n"], [" ", "a,b"]])
def test_words_that_tokenize_to_nothing_are_refused(tiny, capsys, words):
    """seed 5 case 6 (flags): `run --bad_words " "` was an IndexError (an empty id list)."""
    one_line(capsys, run(tiny, "--bad_words", *words), 2, "bad_words", "the tokenizer makes no token of it")
    one_line(capsys, ["run", "--engine_dir", str(tiny / "engine"), "--input_text", "w1", "--stop_words", " "], 2,
             "stop_words ' '")


# --- item 2: a note never precedes an error --------------------------------------------------------
def test_the_length_note_comes_after_the_outputs(tiny, capsys):
    """seed 0 case 369: the --max_output_len note, then the --lora_task_uids error: two lines."""
    one_line(capsys, run(tiny, "--max_output_len", "1000000", "--lora_task_uids", "0"), 2, "--lora_task_uids")
    assert main(run(tiny, "--max_output_len", "1000000")) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("note: --max_output_len 1,000,000") and err[1].startswith("[bestiary]"), err


# --- item 3: limits and paths are the user's (exit 2) ----------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--max_batch_size", "2147483648"], ["argument --max_batch_size: '2147483648': expected at most 2,147,483,647"]),
    (["--max_tokens_in_paged_kv_cache", str(2**31)], ["argument --max_tokens_in_paged_kv_cache"]),
    (["--max_num_tokens", str(2**63)], ["argument --max_num_tokens"]),
])
def test_build_limits_past_32_bits_are_parser_errors(tiny, tmp_path, capsys, flags, words):
    """seed 1 case 626 / seed 0 case 600: exit 1 "the KV cache ... needs 1,024.0 GiB" for a typo."""
    parser_error(capsys, build(tiny, tmp_path / "out", *flags), *words)
    assert not (tmp_path / "out").exists()


def test_a_pool_past_32_bits_is_the_users_a_pool_this_host_cannot_hold_is_not(tiny, tmp_path, capsys, monkeypatch):
    """max_batch_size * max_seq_len past INT32_MAX tokens: exit 2 naming both; within it, too large for
    this host: the memory check's exit 1 (core/cli/failures.py's table)."""
    out = tmp_path / "out"
    one_line(capsys, build(tiny, out, "--max_batch_size", "1000000000", "--max_seq_len", "64"), 2,
             "--max_batch_size 1,000,000,000 * --max_seq_len 64", "64,000,000,000 tokens", "2,147,483,647")
    one_line(capsys, build(tiny, out, "--max_batch_size", "20000000"), 2,  # max_seq_len: the model's 128
             "--max_batch_size 20,000,000 * max_seq_len 128 (the model's positions)")
    one_line(capsys, build(tiny, out, "--max_tokens_in_paged_kv_cache", str(INT32_MAX)), 2,
             "2,147,483,648 tokens")  # rounded up to whole blocks of 32: one token past the count
    from bestiary.core.convert import memory
    from bestiary.core.format.resources import Limit

    monkeypatch.setattr(memory, "memory_capacity", lambda: Limit(2**20, "cgroup memory.max of /job"))
    one_line(capsys, build(tiny, out, "--max_batch_size", "64"), 1, "lower --max_batch_size", "--skip_memory_check")
    assert not out.exists()


@pytest.mark.parametrize("where", ["text.txt/sub", "text.txt/a/b"])
def test_an_output_under_a_file_is_the_users(tiny, tmp_path, capsys, where):
    """seed 0 case 444: `build --output_dir text.txt/sub` was exit 1 "cannot write there (File exists)"."""
    (tmp_path / "text.txt").write_text("my notes\n")
    one_line(capsys, build(tiny, tmp_path / where), 2, f"--output_dir {tmp_path / where}:",
             f"{tmp_path / 'text.txt'} is not a directory")
    assert (tmp_path / "text.txt").read_text() == "my notes\n"
    one_line(capsys, ["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file",
                      str(tmp_path / f"{where}.flm")], 2, "--output_file", "is not a directory")


def test_a_name_too_long_is_the_users(tiny, tmp_path, capsys):
    """seed 1 cases 635 / 809: `inspect W/a*300`, `export --checkpoint_dir W/a*300`: exit 1 "File name too long"."""
    long = str(tmp_path / LONG)
    parser_error(capsys, ["inspect", long], "bestiary inspect: error: argument directory:", "is 300 bytes long",
                 "more than the 255 this filesystem allows")
    parser_error(capsys, ["export", "--checkpoint_dir", long, "--output_file", str(tmp_path / "o.flm")],
                 "argument --checkpoint_dir")
    parser_error(capsys, build(tiny, long), "argument --output_dir")
    parser_error(capsys, run(tiny, "--lora_dir", long), "argument --lora_dir")
    fits_not_its_temp = str(tmp_path / ("b" * (255 - TEMP_ROOM + 1)))  # its temporary name would be too long
    one_line(capsys, build(tiny, fits_not_its_temp), 2, "--output_dir", f"more than the {255 - TEMP_ROOM} an "
             "output's name may have", "less 31 for the temporary name")
    assert main(build(tiny, tmp_path / ("c" * (255 - TEMP_ROOM)))) == 0  # the longest name an output may have
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_path_limits(tmp_path):
    """core.format.path_limits and the output checks that use it, by themselves."""
    assert path_problem(tmp_path / "a" / "b") is None and path_problem("") is None
    assert "300 bytes" in path_problem(tmp_path / LONG / "x")
    assert "bytes long, more than the 4,095" in path_problem("/" + "d/" * 2100)
    assert path_problem(tmp_path / ("é" * 128)) is not None  # 256 bytes in UTF-8: names count bytes
    (tmp_path / "f").write_text("x")
    assert file_in_the_way(tmp_path / "f" / "g" / "h") == tmp_path / "f"
    assert file_in_the_way(tmp_path / "new" / "g") is None and file_in_the_way(tmp_path / "f") is None
    with pytest.raises(BestiaryError, match="--out .*f is not a directory"):
        check_output_dir(tmp_path / "f" / "g", "engine", flag="--out")
    with pytest.raises(BestiaryError, match="--out .*300 bytes long"):
        check_output_file(tmp_path / LONG, flag="--out")
    assert path_arg(str(tmp_path / "x")) == str(tmp_path / "x")
    with pytest.raises(argparse.ArgumentTypeError, match="300 bytes"):
        path_arg(str(tmp_path / LONG))
    assert os.listdir(tmp_path) == ["f"]
