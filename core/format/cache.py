"""The per-user cache directory: on-the-fly conversions, compiled CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$BESTIARY_CACHE, or ~/.cache/bestiary."""
    return Path(os.environ.get("BESTIARY_CACHE", Path.home() / ".cache" / "bestiary"))
