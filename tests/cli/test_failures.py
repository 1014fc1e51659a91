"""One line, not a traceback: bad text, tokenizers, templates, limits, NaN weights, API misuse.

Each test is a case of issue 15 that used to print a traceback, run silently wrong, or run for
minutes; the CLI's one error path (core.cli.failures) prints one line with exit code 2 for bad
input and 1 for a machine fault.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("failures"), tokenizer=True)


def run(engine, *extra) -> list[str]:
    return ["run", "--engine_dir", str(engine), *extra]


# --- text that is not UTF-8 -------------------------------------------------------------------
def test_non_utf8_arguments_and_files(tiny, tmp_path, capsys):
    bad = "caf\udce9"  # what Python makes of the byte 0xe9 in argv
    one_line(capsys, run(tiny / "engine", "--input_text", bad), 2, "--input_text", "0xe9")
    one_line(capsys, run(tiny / "engine", "--input_text", "a", "--stop_words", bad), 2, "--stop_words", "0xe9")
    text = tmp_path / "latin1.txt"
    text.write_bytes("caf\xe9 au lait".encode("latin-1"))
    one_line(capsys, ["eval", "--engine_dir", str(tiny / "engine"), "--text_file", str(text)], 2,
             str(text), "not UTF-8", "0xe9")
    one_line(capsys, ["convert", "--model_dir", str(tiny / "hf"), "--output_dir", str(tmp_path / "o"),
                      "--int8_kv_cache", "--calib_text", str(text)], 2, "--calib_text", "not UTF-8")
    assert not (tmp_path / "o").exists()


def test_non_utf8_input_text_as_a_real_process(tiny):
    """The bytes come through argv as the OS gives them."""
    result = subprocess.run([sys.executable.encode(), b"-m", b"bestiary", b"run", b"--engine_dir",
                             str(tiny / "engine").encode(), b"--input_text", b"caf\xe9"],
                            capture_output=True, check=False)
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines() == [
        "error: --input_text: not valid UTF-8 text (byte 0xe9 at character 3); pass UTF-8 text"]


# --- tokenizer files and chat templates --------------------------------------------------------
@pytest.mark.parametrize("name,content,words", [
    ("tokenizer.json", b"{\"model\": ", ["tokenizer.json", "not a valid tokenizer.json"]),
    ("tokenizer.json", b"{}", ["tokenizer.json", "not a valid tokenizer.json"]),
    ("tokenizer.json", b"\xff\xfe garbage", ["tokenizer.json", "not"]),
    ("tokenizer_config.json", b"[1, 2", ["tokenizer_config.json", "not valid JSON"]),
    ("tokenizer_config.json", b"[1, 2]", ["tokenizer_config.json", "expected a JSON object"]),
    ("tokenizer_config.json", b'{"eos_token": 7}', ["tokenizer_config.json", "eos_token 7"]),
    ("tokenizer_config.json", b'{"chat_template": 5}', ["tokenizer_config.json", "chat_template"]),
])
def test_garbage_tokenizer_files_at_convert_and_at_run(tiny, tmp_path, capsys, name, content, words):
    src, engine = tmp_path / "src", tmp_path / "engine"
    shutil.copytree(tiny / "hf", src)
    shutil.copytree(tiny / "engine", engine)
    (src / name).write_bytes(content)
    (engine / name).write_bytes(content)
    one_line(capsys, ["convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out")], 2, *words)
    assert not (tmp_path / "out").exists()
    one_line(capsys, run(engine, "--input_text", "a b"), 2, *words)


def test_chat_template_syntax_error_names_the_file_and_line(tiny, tmp_path, capsys):
    engine = tmp_path / "engine"
    shutil.copytree(tiny / "engine", engine)
    config = json.loads((engine / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
    (engine / "tokenizer_config.json").write_text(json.dumps(config))
    one_line(capsys, run(engine, "--input_text", "a b", "--chat"), 2, "tokenizer_config.json", "chat template",
             "line 2")
    assert main(run(engine, "--input_text", "a b", "--max_output_len", "2")) == 0  # without --chat it runs


# --- limits --------------------------------------------------------------------------------------
def test_build_refuses_a_kv_cache_larger_than_this_host(tiny, tmp_path, capsys):
    """`build --max_batch_size 100000` succeeded, then `run` died allocating terabytes. A pool the
    engine can count (INT32_MAX tokens) that this host cannot hold is the host's limit (exit 1); past
    that count it is a mistake in the flags (exit 2, tests/cli/test_flag_values.py)."""
    out = tmp_path / "engine"
    one_line(capsys, ["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(out),
                      "--max_tokens_in_paged_kv_cache", str(2**31 - 32)], 1,
             "2,147,483,616 tokens", "GiB", "--max_tokens_in_paged_kv_cache", "--skip_memory_check")
    one_line(capsys, ["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(out),
                      "--max_batch_size", "10000000"], 1, "--max_batch_size")
    assert not out.exists()


def test_load_refuses_a_kv_pool_that_does_not_fit(tiny, tmp_path, capsys):
    out = tmp_path / "engine"
    assert main(["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(out),
                 "--max_tokens_in_paged_kv_cache", str(2**31 - 32), "--skip_memory_check"]) == 0
    capsys.readouterr()
    one_line(capsys, run(out, "--input_ids", "1,2"), 1, "KV cache of 2,147,483,616 tokens", "available",
             "--max_tokens_in_paged_kv_cache")


def test_max_output_len_past_the_engine_is_said(tiny, tmp_path, capsys):
    """--max_output_len 10**9 used to generate up to max_seq_len with no notice."""
    engine = tmp_path / "short"
    assert main(["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(engine), "--max_seq_len", "12"]) == 0
    assert main(run(engine, "--input_ids", "1,2", "--max_output_len", str(10**9), "--ignore_eos")) == 0
    out, err = capsys.readouterr()
    assert "note: --max_output_len 1,000,000,000" in err and "max_seq_len 12" in err
    assert len(out.split()) == 10  # what the engine allows, and no more
    assert main(run(engine, "--input_ids", "1,2", "--max_output_len", "3")) == 0
    assert "note:" not in capsys.readouterr().err


def test_beam_search_stats_line_has_no_decode_rate(tiny, capsys):
    """It reported 1,147,729 tok/s (the time after the 'first' token, which came with the rest)."""
    assert main(run(tiny / "engine", "--input_ids", "1,2", "--max_output_len", "8", "--num_beams", "3")) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "tokens/s" in x]
    assert "beam search, 3 beams" in line and "decode" not in line
    rate = float(line.split(": ")[1].split(" tokens/s")[0])
    assert 0 < rate < 100_000


def test_streaming_with_log_probs_is_refused(tiny, capsys):
    one_line(capsys, run(tiny / "engine", "--input_ids", "1,2", "--streaming", "--output_log_probs"), 2,
             "--streaming --output_log_probs")


# --- non-finite weights ------------------------------------------------------------------------
def _with_nan(src_dir, dst_dir, file: str, key: str):
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src_dir, dst_dir)
    tensors = load_file(str(dst_dir / file))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[3] = float("nan")
    tensors[key].view(-1)[5] = float("inf")
    save_file(tensors, str(dst_dir / file), metadata={"format": "pt"})
    return torch


def test_nan_weights_are_refused_at_convert_and_at_load(tiny, tmp_path, capsys):
    """They ran silently (every output token 0)."""
    src = tmp_path / "src"
    _with_nan(tiny / "hf", src, "model.safetensors", "model.layers.1.mlp.up_proj.weight")
    one_line(capsys, ["convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out")], 2,
             "model.layers.1.mlp.up_proj.weight", "2 of", "not finite", "--allow_nonfinite")
    assert not (tmp_path / "out").exists()
    assert main(["convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out"), "--allow_nonfinite"]) == 0
    capsys.readouterr()
    engine = tmp_path / "engine"
    _with_nan(tiny / "engine", engine, "rank0.safetensors", "transformer.ln_f.weight")
    one_line(capsys, run(engine, "--input_ids", "1,2"), 2, "rank0.safetensors", "transformer.ln_f.weight",
             "not finite")
    assert main(run(engine, "--input_ids", "1,2", "--max_output_len", "2", "--allow_nonfinite")) == 0


def test_fp16_overflow_at_convert_is_refused(tiny, tmp_path, capsys):
    src = tmp_path / "src"
    torch = _with_nan(tiny / "hf", src, "model.safetensors", "model.norm.weight")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], 1e6)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    one_line(capsys, ["convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "o"), "--dtype", "float16"],
             2, "model.norm.weight", "not finite")


# --- the Python API ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny):
    from bestiary.core.runtime.llm import LLM

    return LLM(tiny / "engine")


def test_generate_takes_one_text_as_one_prompt(llm):
    """It ran one prompt per character."""
    from bestiary.core.runtime.sampling import SamplingConfig

    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    one = llm.generate("a b c", greedy)
    assert len(one) == 1 and one[0].prompt_ids == llm.generate(["a b c"], greedy)[0].prompt_ids
    ids = llm.generate([5, 6, 7], greedy)
    assert len(ids) == 1 and ids[0].prompt_ids == [5, 6, 7]


@pytest.mark.parametrize("prompt,words", [
    ([[1, 2.5]], "input id 2.5"), ([[1, None]], "input id None"), ([[True, 2]], "input id True"),
    ([3.5], "prompt 3.5"), ([None], "prompt None"),
])
def test_token_ids_that_are_not_integers(llm, prompt, words):
    """Floats and None gave raw torch / tokenizers errors."""
    with pytest.raises(BestiaryError, match=words):
        llm.generate(prompt)


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "length_penalty",
                                   "presence_penalty", "beam_search_diversity_rate"])
def test_non_finite_sampling_values_are_refused(tiny, capsys, field):
    from pydantic import ValidationError

    from bestiary.core.runtime.sampling import SamplingConfig

    for value in (float("inf"), float("nan")):
        with pytest.raises(ValidationError, match=field):
            SamplingConfig(**{field: value})
    flag = {"repetition_penalty": "--repetition_penalty", "length_penalty": "--length_penalty"}.get(field, f"--{field}")
    one_line(capsys, run(tiny / "engine", "--input_ids", "1", flag, "inf"), 2, field)
    one_line(capsys, run(tiny / "engine", "--input_ids", "1", flag, "nan"), 2, field)


# --- the error path itself -----------------------------------------------------------------------
def test_a_wrapped_interrupt_says_interrupted(tiny, monkeypatch, capsys):
    """SIGINT inside safetensors came back as 'cannot read tensor ... UntypedStorage'."""
    import signal

    from bestiary.core.cli import failures
    from bestiary.core.runtime import engine as engine_module

    def interrupted_then_wrapped(*args, **kwargs):
        failures._received.append(signal.SIGINT)  # what the handler records before raising
        raise BestiaryError("rank0.safetensors: cannot read tensor 'x' (UntypedStorage ...)")

    monkeypatch.setattr(engine_module, "load_by_layer", interrupted_then_wrapped)
    assert main(run(tiny / "engine", "--input_ids", "1")) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_os_errors_are_one_line_exit_1_and_debug_shows_the_traceback(tiny, monkeypatch, capsys):
    import errno

    from bestiary.core.runtime import engine as engine_module

    def io_error(model, path, *args, **kwargs):  # core.runtime.rank_weights.load_by_layer's reading
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(engine_module, "load_by_layer", io_error)
    one_line(capsys, run(tiny / "engine", "--input_ids", "1"), 1, "rank0.safetensors: Input/output error")
    monkeypatch.setenv("BESTIARY_DEBUG", "1")
    with pytest.raises(OSError, match="Input/output error"):
        main(run(tiny / "engine", "--input_ids", "1"))


def test_an_unexpected_exception_is_one_line_exit_1(tiny, monkeypatch, capsys):
    from bestiary.core.runtime import engine as engine_module

    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(engine_module, "load_by_layer", bug)
    one_line(capsys, run(tiny / "engine", "--input_ids", "1"), 1, "internal error: ZeroDivisionError",
             "BESTIARY_DEBUG=1")
