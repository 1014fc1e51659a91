"""bestiary.core.cli: the `bestiary` command line (`main`), its handlers and the demo.

Imports: anything of bestiary (inside handlers, so `--help` starts fast). Nothing imports cli.
"""

from __future__ import annotations

from bestiary.core.cli.main import main

__all__ = ["main"]
