"""One rule for what bestiary may replace or delete (core.format.output_dir): only what carries its own mark.

A user's file or directory, whatever its name (`.ckpt.old-20241128`, `.x.tmp-123`, a FastLLM .flm, a PEFT
adapter, a folder under $BESTIARY_CACHE), survives every command byte for byte; bestiary's own temporaries
of dead processes are removed by the next write into the same parent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.format import interrupts, output_dir  # noqa: E402
from bestiary.core.format.staging import staged_dir, staged_file  # noqa: E402
from bestiary.core.sources.flm_format import pack_int, pack_string  # noqa: E402


def listing(root: Path) -> dict[str, str]:
    """Every path under `root` (dirs included) -> sha1 of its bytes ('dir' for a directory)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("ownership"), tokenizer=True)


@pytest.fixture
def users(tmp_path, tiny):
    """tmp_path/out: where the commands write, beside the user's things that look like bestiary's temps."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(tiny / "ckpt", out / ".ckpt.old-20241128")  # a backup: an exact checkpoint copy
    shutil.copytree(tiny / "engine", out / ".engine.old-20241128")
    (out / ".x.old-20241128").mkdir()
    (out / ".x.old-20241128" / "notes.txt").write_text("mine")
    (out / ".x.tmp-123").write_text("mine too")
    (out / ".m.flm.tmp-123").write_bytes(b"\x02\x00\x00\x00" + b"\x00" * 64)  # 0.1.0's export temp name
    return out


def fastllm_flm(path: Path) -> Path:
    """A .flm as FastLLM's exporter makes one: version 2, an info table without bestiary's mark, a vocab."""
    info = {"model_type": "llama", "hidden_size": "64", "bestiary.activation_quant": "none"}
    body = pack_int(2, len(info)) + b"".join(pack_string(k) + pack_string(v) for k, v in info.items())
    path.write_bytes(body + pack_int(1) + pack_int(1, 97, 5) + pack_int(0))
    return path


def test_user_names_that_look_like_temps_survive_every_command(users, tiny, capsys):
    """Item 3: `bk/.ckpt.old-20241128` was deleted by a convert into bk/ (it matched `.NAME.old-<digits>`)."""
    before = listing(users)
    for argv in (["convert", "--model_dir", str(tiny / "hf"), "--output_dir", str(users / "ckpt")],
                 ["convert", "--model_dir", str(tiny / "hf"), "--output_dir", str(users / "ckpt")],
                 ["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(users / "engine")],
                 ["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(users / "engine")],
                 ["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(users / "m.flm")],
                 ["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(users / "m.flm")],
                 ["convert", "--model_dir", str(users / "m.flm"), "--output_dir", str(users / "x")]):
        assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    after = listing(users)
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(p.name for p in users.iterdir() if p.name not in before) == ["ckpt", "engine", "m.flm", "x"]


@pytest.mark.parametrize("kind", ["foreign", "fastllm", "rewritten"])
def test_export_never_replaces_a_file_it_did_not_write(tiny, tmp_path, capsys, kind):
    """Item 2: export overwrote `printf '\\x02\\x00\\x00\\x00my notes' > fake.flm` (and FastLLM's .flm), exit 0."""
    target = tmp_path / "fake.flm"
    if kind == "foreign":
        target.write_bytes(b"\x02\x00\x00\x00my notes")
    elif kind == "fastllm":
        fastllm_flm(target)
    else:  # bestiary's export, then re-saved by another tool: its mark no longer matches
        assert main(["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(target)]) == 0
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF
        target.write_bytes(bytes(data))
    before = target.read_bytes()
    capsys.readouterr()
    one_line(capsys, ["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(target)], 2,
             "--output_file", str(target), "was not written by bestiary")
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.flm"]


def test_export_replaces_its_own_earlier_output(tiny, tmp_path, capsys):
    from bestiary.core.convert.export_flm import is_bestiary_export

    target = tmp_path / "m.flm"
    assert main(["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(target)]) == 0
    assert is_bestiary_export(target)
    first = target.read_bytes()
    assert main(["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(target),
                 "--flm_dtype", "int8"]) == 0
    assert target.read_bytes() != first and is_bestiary_export(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.flm"]


def test_export_into_a_read_only_directory_names_the_output_file(tiny, tmp_path, capsys, monkeypatch):
    """Item 10: the error named the temp file (`.m.flm.tmp-PID: Read-only file system`)."""
    import errno

    from bestiary.core.format import staging

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(staging.Path, "mkdir", read_only)
    out = tmp_path / "m.flm"
    line = one_line(capsys, ["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(out)], 1,
                    f"--output_file {out}:", "Read-only file system")
    assert "bestiary-tmp" not in line and list(tmp_path.iterdir()) == []


KILLED_EXPORT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from bestiary.core.format.staging import staged_file
    with staged_file(Path(sys.argv[1]), lambda: None) as tmp:
        tmp.write_bytes(b"\\x02\\x00\\x00\\x00" + b"\\x00" * 100000)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_exports_temp_is_removed_by_the_rerun(tiny, tmp_path, capsys):
    """Item 4: `.m.flm.tmp-PID` (56 MB) survived SIGKILL and the rerun never removed it."""
    target = tmp_path / "m.flm"
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(target)], check=False)
    assert killed.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".m.flm.bestiary-tmp-")]
    assert (left / "m.flm").stat().st_size > 100000
    assert main(["export", "--checkpoint_dir", str(tiny / "ckpt"), "--output_file", str(target)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.flm"]


def test_a_temp_is_ours_only_with_its_marker(tmp_path):
    """The name alone never counts: marker, pid, token and host must all agree."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = {}
    for label, marker in [("ok", {}), ("token", {"token": "ffffffff"}), ("pid", {"pid": dead.pid + 1}),
                          ("host", {"host": "elsewhere"}), ("magic", {"bestiary": "other"})]:
        path = tmp_path / f".{label}.bestiary-tmp-{dead.pid}-0123abcd"
        path.mkdir()
        info = {"bestiary": "temp", "pid": dead.pid, "token": "0123abcd", "host": output_dir.host(), **marker}
        (path / output_dir.TEMP_MARKER).write_text(json.dumps(info))
        cases[label] = path
    link = tmp_path / f".link.bestiary-tmp-{dead.pid}-0123abcd"
    link.symlink_to(cases["ok"])
    assert output_dir.remove_stale_temps(tmp_path) == [cases["ok"]]
    assert [p.name for p in sorted(tmp_path.iterdir())] == sorted(
        [link.name, *(p.name for label, p in cases.items() if label != "ok")])


def test_an_interrupted_commit_leaves_the_earlier_output(tiny, tmp_path):
    """A remembered signal refuses the rename: the earlier output stays, no temp is left."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny / "ckpt", target)
    before = listing(tmp_path)
    with interrupts.handled():
        interrupts.received.append(signal.SIGINT)  # what the handler records when a library swallows it
        with pytest.raises(interrupts.Interrupted), staged_dir(target, lambda: None) as tmp:
            (tmp / "config.json").write_text("{}")
        with pytest.raises(interrupts.Interrupted), staged_file(tmp_path / "m.flm", lambda: None) as tmp:
            tmp.write_bytes(b"x")
    assert listing(tmp_path) == before


def test_a_signal_during_the_commit_waits_for_the_renames(tiny, tmp_path):
    """Ctrl-C between 'move the old output aside' and 'rename the new one in' used to lose both."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny / "ckpt", target)
    real = output_dir.write_temp_marker
    calls = []

    def signal_mid_commit(directory, token):  # called for the old output, between the two renames
        real(directory, token)
        if ".bestiary-old-" in directory.name:
            calls.append(directory)
            os.kill(os.getpid(), signal.SIGINT)

    from bestiary.core.format import staging

    staging.write_temp_marker = signal_mid_commit
    try:
        with interrupts.handled(), pytest.raises(interrupts.Interrupted):
            with staged_dir(target, lambda: None) as tmp:
                shutil.copytree(tiny / "ckpt", tmp, dirs_exist_ok=True)
                (tmp / "tokenizer_config.json").write_text("{}")
    finally:
        staging.write_temp_marker = real
    assert calls and (target / "tokenizer_config.json").read_text() == "{}"  # the commit completed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_without_the_cli_handler_ctrl_c_is_replayed_after_the_commit(tmp_path):
    """The Python API (no bestiary handler): SIGINT during the renames is held, then raised."""
    assert not interrupts.installed()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever an earlier test left
    with pytest.raises(KeyboardInterrupt), interrupts.committing():
        os.kill(os.getpid(), signal.SIGINT)
        (tmp_path / "done").write_text("yes")
    assert (tmp_path / "done").read_text() == "yes"


def test_lora_convert_never_replaces_a_users_adapter(tiny, tmp_path, capsys):
    """An existing PEFT dir (adapter_config.json + adapter_model.safetensors, nothing else) was overwritten
    file by file by `convert --lora_dir seed --output_dir it`: it did not carry bestiary's mark."""
    mine = tmp_path / "my_adapter"
    mine.mkdir()
    (mine / "adapter_config.json").write_text('{"r": 8}')
    (mine / "adapter_model.safetensors").write_bytes(b"weights")
    before = listing(tmp_path)
    line = one_line(capsys, ["convert", "--lora_dir", str(tiny / "hf"), "--output_dir", str(mine),
                             "--model_dir", str(tiny / "ckpt")], 2, "not a bestiary LoRA conversion")
    assert "adapter_config.json" in line and listing(tmp_path) == before
    assert output_dir.output_kind(mine) is None
    (mine / output_dir.OUTPUT_MARKER).write_text(json.dumps({"bestiary": "lora"}))
    assert output_dir.output_kind(mine) == "lora"


def test_an_engine_with_bundled_lora_is_still_an_engine(tiny, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(tiny / "engine", engine)
    (engine / "lora").mkdir()
    (engine / "lora" / "0.safetensors").write_bytes(b"x")
    assert output_dir.output_kind(engine) == "engine"
    (engine / "lora" / "README").write_text("mine")
    assert output_dir.output_kind(engine) is None


def test_cache_clear_removes_only_what_bestiary_put_there(tiny, tmp_path, monkeypatch, capsys):
    """$BESTIARY_CACHE may be a folder of the user's: `cache clear` used to rmtree engines/, demo/, ... whole."""
    from bestiary.core.format.cache import clear_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("BESTIARY_CACHE", str(cache))
    shutil.copytree(tiny / "engine", cache / "engines" / "0123456789abcdef")
    (cache / "engines" / "0123456789abcdef.json").write_text(json.dumps({"source": "/m", "dtype": "auto"}))
    shutil.copytree(tiny / "ckpt", cache / "checkpoints" / "0123456789abcdef")
    (cache / "cpu-kernels" / "aa").mkdir(parents=True)
    (cache / "cpu-kernels" / "aa" / "libbestiary_cpu_avx2.so").write_bytes(b"\x7fELF")
    (cache / "engines" / "my-notes").mkdir()
    (cache / "engines" / "my-notes" / "notes.txt").write_text("mine")
    (cache / "demo").mkdir()
    (cache / "demo" / "todo.txt").write_text("mine too")
    (cache / "elsewhere.txt").write_text("not a cache folder")
    assert clear_cache() > 0
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    assert left == ["demo", "demo/todo.txt", "elsewhere.txt", "engines", "engines/my-notes",
                    "engines/my-notes/notes.txt"]


def test_an_interrupted_cache_clear_never_leaves_a_half_deleted_entry(tiny, tmp_path, monkeypatch):
    """An entry is renamed aside (marked) before it is deleted: a Ctrl-C during the deletion leaves a
    temporary the next write removes, never an engines/KEY that looks whole and lacks a rank file."""
    from bestiary.core.format import staging
    from bestiary.core.format.cache import clear_cache

    monkeypatch.setenv("BESTIARY_CACHE", str(tmp_path))
    shutil.copytree(tiny / "engine", tmp_path / "engines" / "0123456789abcdef")

    def interrupted(path, ignore_errors=False):
        (Path(path) / "rank0.safetensors").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(staging.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        clear_cache()
    (left,) = list((tmp_path / "engines").iterdir())
    assert left.name.startswith(".0123456789abcdef.bestiary-old-") and output_dir.our_temp(left) is not None
