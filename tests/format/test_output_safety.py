"""Nothing lost: where convert and build may write, temp dirs of dead processes, signals, full disks.

Every refusal is one line, exit code 2 (1 for a machine fault), and leaves every directory as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.format import output_dir  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.format.output_dir import check_output_file  # noqa: E402


def listing(root: Path) -> dict[str, str]:
    """Every path under `root` (dirs included) -> sha1 of its bytes ('dir' for a directory)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("safety"))


@pytest.fixture
def work(tiny, tmp_path, monkeypatch):
    """A scratch copy of the tiny source, checkpoint and engine, with an unrelated non-empty dir
    ('mine': a file and a subfolder) and the current directory inside it ('cwd': a file)."""
    for name in ("hf", "ckpt", "engine"):
        shutil.copytree(tiny / name, tmp_path / name)
    (tmp_path / "mine" / "sub").mkdir(parents=True)
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    (tmp_path / "mine" / "sub" / "data.bin").write_bytes(b"\x00\x01")
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "file.txt").write_text("here")
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def refused(capsys, argv: list[str], *words: str, code: int = 2) -> str:
    return one_line(capsys, argv, code, *words)


def convert(src, out, *extra):
    return ["convert", "--model_dir", str(src), "--output_dir", str(out), *extra]


def build(ckpt, out, *extra):
    return ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(out), *extra]


def test_no_command_modifies_cwd_source_or_an_unrelated_dir(work, capsys):
    """The issue's data-loss cases: a listing with hashes before and after every command."""
    before = listing(work)
    cwd, home = work / "cwd", Path.home()
    cases = [
        (convert(work / "hf", work / "mine"), "not empty and not a bestiary checkpoint"),
        (convert(work / "hf", "."), "is the current directory"),
        (convert(work / "hf", work), "an ancestor of the current directory"),
        (convert(work / "hf", "/"), "an ancestor of the current directory"),
        (convert(work / "hf", home), "home directory"),
        (convert(work / "hf", work / "hf"), "is the source"),
        (convert(work / "hf" / "model.safetensors", work / "hf"), "containing the source"),
        (convert(work / "hf", work / "engine"), "holds a bestiary engine, not a checkpoint"),
        (build(work / "ckpt", work / "ckpt"), "is the source"),
        (build(work / "ckpt", work / "mine"), "not empty and not a bestiary engine"),
        (build(work / "ckpt", cwd), "is the current directory"),
        (build(work / "ckpt", work / "hf"), "not empty and not a bestiary engine"),
        (build(work / "ckpt", work / "ckpt" / ".."), "an ancestor of the current directory"),
        (build(work / "engine", work / "engine"), "is the source"),
    ]
    for argv, words in cases:
        refused(capsys, argv, words)
    assert listing(work) == before
    for argv in (["run", "--engine_dir", str(work / "engine"), "--input_ids", "1,2", "--max_output_len", "2"],
                 ["inspect", str(work / "engine")], ["eval", "--engine_dir", str(work / "engine"),
                                                      "--text_file", str(cwd / "file.txt")]):
        assert main(argv) in (0, 2)
        capsys.readouterr()
    assert listing(work) == before


def test_a_missing_empty_or_earlier_output_is_written(work, capsys):
    (work / "empty").mkdir()
    for out in (work / "new" / "nested", work / "empty", work / "ckpt"):
        assert main(convert(work / "hf", out)) == 0
        assert output_dir.output_kind(out) == "checkpoint"
    assert main(build(work / "ckpt", work / "engine", "--max_seq_len", "64")) == 0
    assert output_dir.output_kind(work / "engine") == "engine"
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


def test_an_earlier_output_with_a_foreign_file_is_refused(work, capsys):
    (work / "ckpt" / "README.md").write_text("my notes")
    before = listing(work)
    refused(capsys, convert(work / "hf", work / "ckpt"), "'README.md'")
    assert listing(work) == before


def test_mount_point_is_refused_before_anything_is_written(work, capsys, monkeypatch):
    """It used to convert, fail to rename over the mount point, and leave the full temp dir behind."""
    (work / "mnt").mkdir()
    (work / "mnt" / "lost+found").mkdir()
    real = os.path.ismount
    monkeypatch.setattr(output_dir.os.path, "ismount", lambda p: str(p) == str(work / "mnt") or real(p))
    before = listing(work)
    refused(capsys, convert(work / "hf", work / "mnt"), "mount point")
    assert listing(work) == before


@pytest.mark.parametrize("where", ["mkdir", "write"])
def test_read_only_or_full_filesystem_is_one_line_exit_1(work, capsys, monkeypatch, where):
    """OSError used to be a traceback; ENOSPC mid-write must leave nothing behind."""
    from bestiary.core.format import checkpoint

    if where == "mkdir":
        def fail(self, *a, **k):
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(checkpoint.Path, "mkdir", fail)
        words = ("Read-only file system",)
    else:
        def fail(self, name, tensor):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint.StreamingSafetensorsWriter, "write", fail)
        words = ("No space left on device", "nothing was written")
    before = listing(work)
    refused(capsys, convert(work / "hf", work / "out"), "--output_dir", *words, code=1)
    refused(capsys, convert(work / "hf", work / "ckpt"), *words, code=1)
    assert listing(work) == before


def _temp(parent: Path, name: str, pid: int, token: str = "0123abcd", marker: bool = True) -> Path:
    """A temp dir as bestiary names and marks it (`.NAME.bestiary-tmp-PID-TOKEN`), for process `pid`."""
    path = parent / f".{name}.bestiary-tmp-{pid}-{token}"
    path.mkdir()
    if marker:
        info = {"bestiary": "temp", "pid": pid, "token": token, "host": output_dir.host()}
        (path / output_dir.TEMP_MARKER).write_text(json.dumps(info))
    return path


def test_stale_temp_dirs_of_dead_processes_are_removed_on_the_next_write(work, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = _temp(work, "ckpt", dead.pid)
    (stale / "rank0.safetensors").write_bytes(b"\x00" * 1000)
    alive = _temp(work, "other", os.getpid())  # a running process's: kept
    unmarked = _temp(work, "notes", dead.pid, marker=False)  # not bestiary's: kept
    elsewhere = _temp(work, "nfs", dead.pid, token="9999ffff")  # another host's (a shared filesystem): kept
    info = json.loads((elsewhere / output_dir.TEMP_MARKER).read_text())
    (elsewhere / output_dir.TEMP_MARKER).write_text(json.dumps({**info, "host": "another-host"}))
    legacy = work / f".old.tmp-{dead.pid}"  # bestiary 0.1.0's name, its marker holding the pid: removed
    legacy.mkdir()
    (legacy / output_dir.TEMP_MARKER).write_text(str(dead.pid))
    assert main(convert(work / "hf", work / "fresh")) == 0
    assert not stale.exists() and not legacy.exists()
    assert alive.exists() and unmarked.exists() and elsewhere.exists()


def _wait_for(pattern: str, parent: Path, proc: subprocess.Popen, timeout: float = 120.0) -> Path:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = [p for p in parent.glob(pattern) if (p / "rank0.safetensors").exists()]
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"no {pattern} in {parent}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_mid_convert_leave_nothing_and_say_interrupted(smollm2_gguf, tmp_path, sig):
    """SIGTERM used to leave .NAME.tmp-PID/ (hundreds of MB); SIGINT sometimes said 'cannot read tensor'."""
    proc = subprocess.Popen([sys.executable, "-m", "bestiary", *convert(smollm2_gguf, tmp_path / "out")],
                            stderr=subprocess.PIPE, text=True)
    _wait_for(".out.bestiary-tmp-*", tmp_path, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert err.strip() == "interrupted"
    assert list(tmp_path.iterdir()) == []


def test_sigkill_leftover_is_removed_by_the_next_convert(smollm2_gguf, tiny, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "bestiary", *convert(smollm2_gguf, tmp_path / "out")],
                            stderr=subprocess.DEVNULL)
    left = _wait_for(".out.bestiary-tmp-*", tmp_path, proc)
    proc.kill()
    proc.wait()
    assert left.exists()
    assert main(convert(tiny / "hf", tmp_path / "other")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_check_output_file_for_single_file_writers(work):
    """The shared check for verbs that write one file (e.g. an export)."""
    src = work / "hf" / "model.safetensors"
    assert check_output_file(work / "model.flm", [work / "hf"]) == (work / "model.flm").resolve()
    for path, words in ((src, "is the source"), (work / "mine", "is a directory"),
                        (work / "mine" / "notes.txt", "not written by bestiary"),
                        (work / "nowhere" / "x.flm", "does not exist")):
        with pytest.raises(BestiaryError, match=words):
            check_output_file(path, [src])
    (work / "old.flm").write_bytes(b"FLM")
    assert check_output_file(work / "old.flm", replaceable=lambda p: p.read_bytes().startswith(b"FLM"))
