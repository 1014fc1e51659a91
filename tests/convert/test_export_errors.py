"""`bestiary export` on a corrupt rank0.safetensors: one stderr line naming the file (and tensor), exit 2,
no output file; the progress bar is drawn only on a terminal and erased there when the export fails."""

from __future__ import annotations

import io
import json
import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from rich.console import Console  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_llama import make_tiny_llama, write_tiny_tokenizer  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.convert import progress as progress_module  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("export_errors")
    src = make_tiny_llama(base)
    write_tiny_tokenizer(src)
    return convert(src, base / "ckpt", show_progress=False)


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _corrupt(header: dict, data: bytes, case: str) -> bytes:
    """rank0.safetensors' bytes with the fuzzer's corruption `case` applied."""
    key = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 1)
    blob = json.dumps(header).encode()
    if case == "length 0":
        return struct.pack("<Q", 0) + blob + data
    if case == "length 2^40":
        return struct.pack("<Q", 2 ** 40) + blob + data
    if case == "not utf-8":
        blob = blob.replace(b'"dtype"', b'"dty\x85e"', 1)
    elif case == "truncated":
        return (struct.pack("<Q", len(blob)) + blob + data)[:-1000]
    else:  # dtype '', shape []
        field, value = {"dtype ''": ("dtype", ""), "shape []": ("shape", [])}[case]
        header[key][field] = value
        blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


@pytest.mark.parametrize(("case", "expect"), [
    ("length 0", "safetensors header length 0 does not fit the file"),
    ("length 2^40", "safetensors header length 1099511627776 does not fit the file"),
    ("not utf-8", "safetensors header is not UTF-8 text"),
    ("truncated", "(the file is truncated or its header is corrupt)"),
    ("dtype ''", "dtype ''; expected one of F32"),
    ("shape []", "needs"),
])
def test_corrupt_rank_file_is_one_line_naming_it(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 case: str, expect: str) -> None:
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    header, data = _header_and_data(ckpt / "rank0.safetensors")
    (bad / "rank0.safetensors").write_bytes(_corrupt(header, data, case))
    out = tmp_path / "m.flm"
    err = one_line(capsys, ["export", "--checkpoint_dir", str(bad), "--output_file", str(out)], 2,
                   f"{bad / 'rank0.safetensors'}: ", expect)
    assert "export ━" not in err and not out.exists()


@pytest.mark.parametrize(("case", "expect"), [
    ("transposed", "tensor 'transformer.layers.0.attention.qkv.weight' is F32 [64, 128]; the model needs F32 [128, 64]"),
    ("flattened", "tensor 'transformer.layers.0.attention.qkv.weight' is F32 [8192]; the model needs F32 [128, 64]"),
    ("retyped", "tensor 'transformer.layers.0.attention.qkv.weight' is I32 [128, 64]; the model needs F32 [128, 64]"),
    ("missing", "missing tensor 'transformer.layers.0.attention.qkv.weight'"),  # was exit 0, a .flm without it
    ("renamed", "missing tensor 'transformer.layers.0.attention.qkv.weight'"),
    ("extra", "unexpected tensor 'transformer.layers.0.attention.qkv.weight.copy'"),
])
def test_well_formed_file_of_the_wrong_tensors_is_refused(ckpt: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str], case: str,
                                                          expect: str) -> None:
    """A header that is valid safetensors but does not match the model (was a split_with_sizes "internal
    error", or exit 0 with a tensor left out)."""
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    header, data = _header_and_data(ckpt / "rank0.safetensors")
    key = "transformer.layers.0.attention.qkv.weight"
    entry = header[key]
    if case == "transposed":
        entry["shape"] = entry["shape"][::-1]
    elif case == "flattened":
        entry["shape"] = [entry["shape"][0] * entry["shape"][1]]
    elif case == "retyped":
        entry["dtype"] = "I32"
    elif case == "renamed":
        header[key + "x"] = header.pop(key)
    if case in ("missing", "extra"):  # written whole: a tensor's bytes go with it (no hole, no shared bytes)
        tensors = load_file(str(ckpt / "rank0.safetensors"))
        if case == "missing":
            del tensors[key]
        else:
            tensors[key + ".copy"] = tensors[key].clone()
        save_file(tensors, str(bad / "rank0.safetensors"))
    else:
        blob = json.dumps(header).encode()
        (bad / "rank0.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    out = tmp_path / "m.flm"
    one_line(capsys, ["export", "--checkpoint_dir", str(bad), "--output_file", str(out)], 2,
             f"{bad / 'rank0.safetensors'}: ", expect)
    assert not out.exists()


@pytest.mark.parametrize("algo", ["W8A8_SQ_PER_CHANNEL", "FP8", "W4A8_AWQ"])
def test_activation_quantized_models_are_refused(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 algo: str) -> None:
    """FastLLM files hold weight-only linears: a SmoothQuant / FP8 checkpoint was a split_with_sizes
    "internal error" in the inverse qkv hook."""
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization"]["quant_algo"] = algo
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "m.flm"
    one_line(capsys, ["export", "--checkpoint_dir", str(bad), "--output_file", str(out)], 2,
             f"{bad}: quant_algo {algo} (activation-quantized)")
    assert not out.exists()


def _edit_tokenizer(data: dict, case: str) -> str:
    """tokenizer.json's text with the change `case`."""
    if case == "not json":
        return '{"model": '
    if case == "added token without id":
        data["added_tokens"] = [{"content": "x"}]
    elif case == "vocab a list":
        data["model"]["vocab"] = [1, 2]
    else:  # merges a word-level model ignores (as tokenizers does), with or without model.type
        data["model"]["merges"] = [1]
        if case == "stray merges, no type":
            del data["model"]["type"]
    return json.dumps(data)


@pytest.mark.parametrize(("case", "expect"), [
    ("not json", "not a valid tokenizer.json (EOF while parsing"),  # was a JSONDecodeError "internal error"
    ("added token without id", "not a valid tokenizer.json (missing field `id`"),  # was KeyError 'id'
    ("vocab a list", "not a valid tokenizer.json (invalid type: sequence, expected a map"),  # was AttributeError
    ("stray merges", None),  # was TypeError: cannot unpack non-iterable int object
    ("stray merges, no type", None),
])
def test_tokenizer_is_validated_as_a_run_validates_it(ckpt: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str], case: str,
                                                      expect: str | None) -> None:
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    tok = bad / "tokenizer.json"
    tok.write_text(_edit_tokenizer(json.loads(tok.read_text()), case))
    out = tmp_path / "m.flm"
    argv = ["export", "--checkpoint_dir", str(bad), "--output_file", str(out)]
    if expect is None:
        assert main(argv) == 0 and out.is_file()
    else:
        one_line(capsys, argv, 2, f"{tok}: ", expect)
        assert not out.exists()


def _bar_output(monkeypatch: pytest.MonkeyPatch, fail: bool) -> str:
    """What progress() writes to a terminal for one task advanced twice, ending normally or by an error."""
    buffer = io.StringIO()
    monkeypatch.setattr(progress_module, "STDERR", Console(file=buffer, force_terminal=True, width=80))
    try:
        with progress_module.progress(True) as bar:
            task = bar.add_task("export", total=None)
            bar.advance(task)
            bar.advance(task)
            if fail:
                raise ValueError("bad input")
    except ValueError:
        pass
    return buffer.getvalue()


def test_progress_bar_is_erased_on_a_terminal_when_the_block_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    erase_line_above = "\x1b[1A\x1b[2K"
    kept = _bar_output(monkeypatch, fail=False)
    assert "export" in kept and erase_line_above not in kept  # a finished bar stays on screen
    erased = _bar_output(monkeypatch, fail=True)
    assert erased.endswith("\r" + erase_line_above)  # the bar's line is cleared: the error line stands alone
