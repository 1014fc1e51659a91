"""`bestiary run|chat|serve|eval MODEL`: any source (here a tiny random HF LLaMA dir) is converted and built
into the cache on the first start, and the second start loads the cached engine without converting
(`convert` is spied on). MODEL and --engine_dir are one argument; a missing path, an unsupported file, a
directory that is no model, both or neither given are one line naming MODEL (or --engine_dir), exit 2,
before anything is hashed or converted. Before: `run MODEL` was refused by the parser (--engine_dir
required), and `eval --engine_dir HF_DIR` failed with "config.json: field 'architecture' is missing"
(it loaded the source as an engine)."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama, write_tiny_tokenizer  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.cli.model_arg import ERASE_LINE  # noqa: E402

NEW = ["--max_output_len", "2"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random HF LLaMA dir with a word-level tokenizer and a chat template."""
    src = make_tiny_llama(tmp_path_factory.mktemp("model_arg"))
    write_tiny_tokenizer(src)
    return src


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own (the CPU kernels off: their build is not under test)."""
    monkeypatch.setenv("BESTIARY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BESTIARY_CPU_KERNELS", "off")
    return tmp_path / "cache"


@pytest.fixture
def converts(monkeypatch):
    """The sources `convert` is called on (ensure_engine imports it when it converts)."""
    import bestiary.core.convert.source_to_checkpoint as stc

    calls, real = [], stc.convert

    def spy(path, *args, **kwargs):
        calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(stc, "convert", spy)
    return calls


def started(capsys, argv: list[str]) -> tuple[str, str]:
    """(stdout, stderr) of `bestiary ARGV`, which must succeed."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def engines(cache) -> list[str]:
    return sorted(p.name for p in (cache / "engines").iterdir() if p.is_dir())


def assert_cold_then_warm(cold_err: str, warm_err: str, source, cache) -> None:
    """stderr is no terminal here: neither start says anything of the cache (a status line before an error
    would make the error two lines); one engine was made."""
    (engine,) = engines(cache)
    assert "into the cache" not in cold_err and "cached engine" not in warm_err
    assert (cache / "engines" / engine / "config.json").is_file()


def test_run_converts_once_then_starts_from_the_cache(source, cache, converts, capsys):
    argv = ["--input_text", "w1 w2", *NEW, "--output_ids"]
    cold, cold_err = started(capsys, ["run", str(source), *argv])
    warm, warm_err = started(capsys, ["run", "--engine_dir", str(source), *argv])  # the flag: the same model
    assert converts == [str(source)] and cold == warm and len(cold.split()) == 2
    assert_cold_then_warm(cold_err, warm_err, source, cache)


def test_run_dtype_is_its_own_cache_entry(source, cache, converts, capsys):
    started(capsys, ["run", str(source), "--input_ids", "4", *NEW])
    started(capsys, ["run", str(source), "--input_ids", "4", *NEW, "--dtype", "float16"])
    started(capsys, ["run", str(source), "--input_ids", "4", *NEW, "--dtype", "float16"])
    assert converts == [str(source)] * 2 and len(engines(cache)) == 2
    dtypes = {json.loads((cache / "engines" / e / "config.json").read_text())["pretrained_config"]["dtype"]
              for e in engines(cache)}
    assert dtypes == {"float32", "float16"}


def test_chat_converts_once_then_starts_from_the_cache(source, cache, converts, capsys, monkeypatch):
    def chat() -> tuple[str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2\n"))  # a pipe: one answer line per message
        return started(capsys, ["chat", str(source), *NEW])

    (cold, cold_err), (warm, warm_err) = chat(), chat()
    assert converts == [str(source)] and cold == warm and cold.count("\n") == 1
    assert_cold_then_warm(cold_err, warm_err, source, cache)


def test_eval_converts_once_then_starts_from_the_cache(source, cache, converts, capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("w1 w2 w3 a b c w4")
    cold, cold_err = started(capsys, ["eval", str(source), "--text_file", str(text)])
    warm, warm_err = started(capsys, ["eval", "--engine_dir", str(source), "--text_file", str(text)])
    assert converts == [str(source)] and cold == warm and json.loads(cold)["tokens"] > 0
    assert_cold_then_warm(cold_err, warm_err, source, cache)


def test_serve_converts_once_then_starts_from_the_cache(source, cache, converts, capsys, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    apps: list = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))  # started, then stopped at once
    _, cold_err = started(capsys, ["serve", str(source), "--port", "0"])
    _, warm_err = started(capsys, ["serve", str(source), "--port", "0"])
    assert converts == [str(source)] and len(apps) == 2
    assert_cold_then_warm(cold_err, warm_err, source, cache)
    assert f"bestiary serve: '{source.name}' on" in warm_err  # the model id: MODEL's name, not the cache key


def test_an_engine_dir_is_used_as_it_is(source, cache, converts, capsys):
    started(capsys, ["run", str(source), "--input_ids", "4", *NEW])
    (engine,) = engines(cache)
    _, err = started(capsys, ["run", str(cache / "engines" / engine), "--input_ids", "4", *NEW])
    assert converts == [str(source)] and "into the cache" not in err and "cached engine" not in err


ARGS = {"run": ["--input_ids", "4"], "chat": [], "serve": [], "eval": ["--text_file", "t.txt"]}


def bad_models(tmp_path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (MODEL argv, words the one error line must hold)."""
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')
    return {
        "missing": ([str(tmp_path / "none")], [f"MODEL {tmp_path / 'none'}", "no such file"]),
        "missing flag": (["--engine_dir", str(tmp_path / "none")], [f"--engine_dir {tmp_path / 'none'}", "no such"]),
        "unsupported file": ([str(tmp_path / "notes.txt")], ["MODEL", "notes.txt", "'.txt'", ".gguf"]),
        "empty dir": ([str(tmp_path / "empty")], ["MODEL", "empty", "without config.json"]),
        "neither dir": ([str(tmp_path / "other")], ["MODEL", "other", "no weights"]),
        "both": ([str(tmp_path / "empty"), "--engine_dir", str(tmp_path / "empty")], ["MODEL", "--engine_dir", "one"]),
        "neither given": ([], ["MODEL or --engine_dir: required"]),
    }


@pytest.mark.parametrize("command", list(ARGS))
@pytest.mark.parametrize("case", ["missing", "missing flag", "unsupported file", "empty dir", "neither dir", "both",
                                  "neither given"])
def test_a_bad_model_is_one_line_naming_it(command, case, tmp_path, cache, converts, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("w1 w2")
    argv, words = bad_models(tmp_path)[case]
    capsys.readouterr()
    assert main([command, *argv, *ARGS[command]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert all(w in err for w in words), err
    assert converts == [] and not cache.exists()  # nothing hashed (the digest index) nor converted


def test_dtype_with_an_engine_dir_is_one_line(source, cache, capsys):
    started(capsys, ["run", str(source), "--input_ids", "4", *NEW])
    (engine,) = engines(cache)
    assert main(["run", str(cache / "engines" / engine), "--input_ids", "4", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype float16" in err and "MODEL" in err and "engine dir" in err


@pytest.fixture
def unreadable_source(source, tmp_path):
    """A copy of the source whose config.json is not JSON: it passes the checks before hashing, and
    fails while it is converted."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    (bad / "config.json").write_text("{")
    return bad


def test_a_failed_conversion_is_one_line(unreadable_source, cache, capsys):
    capsys.readouterr()
    assert main(["run", str(unreadable_source), "--input_ids", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "config.json" in err, err


def test_a_failed_conversion_on_a_terminal_erases_its_announcement(unreadable_source, cache, capsys, monkeypatch):
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["run", str(unreadable_source), "--input_ids", "4"]) == 2
    err = capsys.readouterr().err
    announced = err.index(f"[bestiary] converting {unreadable_source} into the cache (once)...\n")
    assert announced < err.index(ERASE_LINE) < err.index("error: ") and err.endswith("\n"), err
