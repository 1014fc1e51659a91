"""User-facing errors: one line that names the file, key, value or flag and what was expected.

The CLI prints `error: <message>` and exits with the error's `exit_code` (2: bad input,
1: an environment fault such as a read-only or full filesystem or too little memory), without a
traceback unless BESTIARY_DEBUG=1 (core.cli.main).
"""

from __future__ import annotations


class BestiaryError(Exception):
    """A mistake the user can act on (bad path, bad flag, bad checkpoint)."""

    exit_code = 2


class EnvironmentFault(BestiaryError):
    """The input is fine but the machine is not: read-only or full filesystem, too little memory."""

    exit_code = 1


class PluginError(BestiaryError):
    """A plugin's spec is broken: a lazy "module:attr" reference that does not resolve."""


class ConfigError(BestiaryError):
    """A config.json (or HF config) field is missing or has a bad value."""


class WeightsError(BestiaryError):
    """A tensor is missing, unused, truncated or of the wrong shape."""
