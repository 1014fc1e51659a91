"""The CLI's error contract, checked in-process: the exit code, one line on stderr, no traceback."""

from __future__ import annotations


def one_line(capsys, argv: list[str], code: int, *words: str) -> str:
    """Run `bestiary argv` through main(); it must exit with `code` and say `words` in one stderr line."""
    from bestiary.core.cli.main import main

    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err
