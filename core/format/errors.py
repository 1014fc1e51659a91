"""User-facing errors: one line that names the file, key, value or flag and what was expected.

The CLI prints `error: <message>` and exits with code 2, without a traceback.
"""

from __future__ import annotations


class BestiaryError(Exception):
    """A mistake the user can act on (bad path, bad flag, bad checkpoint)."""


class ConfigError(BestiaryError):
    """A config.json (or HF config) field is missing or has a bad value."""


class WeightsError(BestiaryError):
    """A tensor is missing, unused, truncated or of the wrong shape."""
