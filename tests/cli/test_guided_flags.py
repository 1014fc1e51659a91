"""`bestiary run` / `bestiary chat` --json_schema / --json_object / --regex / --grammar / --choice
(core/cli/guided_flags.py): each flag holds the output to its constraint on a tiny random chat engine (its
outputs are whatever the grammar forces), at most one of them, and every mistake is one line naming the
flag (and file) with exit 2, before or after the engine loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("guided_cli"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("guided_files")
    texts = {"schema.json": json.dumps(SCHEMA), "bad_schema.json": '{"type": "foo"}', "not_json.json": "[1, 2",
             "list.json": "[1, 2]", "g.lark": 'start: "x" | "y" "z"\n', "g.gbnf": 'root ::= "hi" | "ho"\n',
             "bad.lark": "start: ???\n", "bad.gbnf": "root ::= (\n"}
    for name, text in texts.items():
        (d / name).write_text(text)
    return d


def run(engine, capsys, *flags: str) -> tuple[int, list[str], str]:
    """(exit code, stdout lines without the stats, stderr) of `bestiary run` in-process."""
    code = main(["run", "--engine_dir", str(engine), "--input_text", "hello", "Tell me", "--max_output_len", "40",
                 *flags])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


@pytest.mark.parametrize("flags,valid", [
    (["--json_schema", "{files}/schema.json"], lambda t: json.loads(t) in ({"color": "red"}, {"color": "blue"})),
    (["--regex", "[ab]{3}"], lambda t: re.fullmatch("[ab]{3}", t)),
    (["--grammar", "{files}/g.lark"], lambda t: t in ("x", "yz")),
    (["--grammar", "{files}/g.gbnf"], lambda t: t in ("hi", "ho")),
    (["--choice", "yes", "no", "maybe so"], lambda t: t in ("yes", "no", "maybe so")),
], ids=["json_schema", "regex", "lark", "gbnf", "choice"])
def test_each_flag_holds_every_output_to_its_constraint(engine, files, capsys, flags, valid):
    code, lines, err = run(engine, capsys, *[f.replace("{files}", str(files)) for f in flags])
    assert code == 0, err
    assert len(lines) == 2 and all(valid(line) for line in lines), lines


def test_json_object_gives_an_object_or_stops_at_the_length_inside_one(engine, capsys):
    code, lines, err = run(engine, capsys, "--json_object")
    assert code == 0, err
    for line in lines:
        assert line.startswith("{")
        try:
            assert isinstance(json.loads(line), dict)
        except json.JSONDecodeError:  # a random model may keep writing until --max_output_len
            pass
    plain = run(engine, capsys)[1]
    assert lines != plain


@pytest.mark.parametrize("flags,message", [
    (["--json_schema", "{files}/none.json"], "--json_schema {files}/none.json: no such text file"),
    (["--json_schema", "{files}/not_json.json"], "--json_schema {files}/not_json.json: not JSON (Expecting ',' "
                                                 "delimiter at line 1 column 6)"),
    (["--json_schema", "{files}/list.json"], "--json_schema {files}/list.json: expected a JSON Schema (a JSON "
                                             "object), got a JSON list"),
    (["--json_schema", "{files}/bad_schema.json"], "--json_schema {files}/bad_schema.json: Invalid type: foo"),
    (["--regex", "[a-"], "--regex '[a-': "),
    (["--grammar", "{files}/bad.lark"], "--grammar {files}/bad.lark: "),
    (["--grammar", "{files}/bad.gbnf"], "--grammar {files}/bad.gbnf: not a GBNF grammar"),
    (["--grammar", "{files}/none.lark"], "--grammar {files}/none.lark: no such text file"),
    (["--choice", "yes", ""], "--choice: empty string"),
    (["--regex", "a+", "--num_beams", "2"], "--regex 'a+' with --num_beams 2: beam search cannot hold its beams"),
], ids=["missing", "not_json", "not_object", "bad_schema", "bad_regex", "bad_lark", "bad_gbnf", "missing_grammar",
        "empty_choice", "beams"])
def test_a_mistake_is_one_line_naming_the_flag_exit_2(engine, files, capsys, flags, message):
    code, lines, err = run(engine, capsys, *[f.replace("{files}", str(files)) for f in flags])
    assert code == 2 and lines == []
    assert err.startswith("error: " + message.replace("{files}", str(files))), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_at_most_one_flag(engine, capsys):
    with pytest.raises(SystemExit) as stop:
        run(engine, capsys, "--regex", "a", "--choice", "b")
    assert stop.value.code == 2
    assert "argument --choice: not allowed with argument --regex" in capsys.readouterr().err


def test_chat_holds_every_answer_to_the_constraint(engine, files, capsys):
    cmd = [sys.executable, "-m", "bestiary", "chat", "--engine_dir", str(engine), "--max_output_len", "30",
           "--json_schema", str(files / "schema.json")]
    done = subprocess.run(cmd, input="hi\nwhat color?\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answers = [line for line in done.stdout.splitlines() if line]
    assert len(answers) == 2 and all(json.loads(a) in ({"color": "red"}, {"color": "blue"}) for a in answers)
    assert main(cmd[3:-1] + [str(files / "bad_schema.json")]) == 2  # refused before a line is read
    assert capsys.readouterr().err == f"error: --json_schema {files / 'bad_schema.json'}: Invalid type: foo\n"
