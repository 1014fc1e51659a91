"""Which spec a name goes to when two plugins register it: bestiary's built-ins win unless the user asks.

A third-party plugin may register a name bestiary has built in (people write their own Qwen3 or
Phi-3 plugin). At start-up nothing crashes; per name:

    preferred (BESTIARY_PREFER_PLUGINS lists its distribution or entry-point name) > built-in > first loaded

- the built-in and a plugin: the built-in stays, and one warning line names the plugin's
  distribution and the variable that would pick it; with the plugin preferred, the plugin's spec
  replaces the built-in one, silently (the user asked);
- two third-party plugins: the preferred one, else the first loaded, with a warning naming both;
- the same rank orders the specs that claim one HF `architectures` entry or `model_type`
  (Registry.for_hf_config), and a third-party spec claiming an HF architecture a built-in reads
  is warned about the same way.

`bestiary list` shows which package each architecture came from; `Registry.shadowed` keeps every
spec set aside (tests, `bestiary list`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

PREFER_ENV = "BESTIARY_PREFER_PLUGINS"
BUILTIN_PACKAGE = "bestiary"  # the distribution of the built-in families (pyproject's entry points)


@dataclass(frozen=True)
class Origin:
    """Where a spec came from: the plugin's entry-point name and its distribution."""

    plugin: str
    package: str

    @property
    def builtin(self) -> bool:
        """One of bestiary's own families."""
        return self.package == BUILTIN_PACKAGE


@dataclass(frozen=True)
class Shadowed:
    """A spec set aside under a name another spec kept: the name, who kept it, who lost it."""

    name: str
    kept: Origin
    dropped: Origin


def preferred_plugins(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Distributions / entry-point names listed in BESTIARY_PREFER_PLUGINS (comma-separated)."""
    raw = (os.environ if environ is None else environ).get(PREFER_ENV, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def rank(origin: Origin, prefer: frozenset[str]) -> int:
    """0 for a preferred plugin, 1 for a built-in, 2 for any other third-party plugin (lower wins)."""
    if {origin.plugin, origin.package} & prefer:
        return 0
    return 1 if origin.builtin else 2


def new_wins(old: Origin, new: Origin, prefer: frozenset[str]) -> bool:
    """Whether `new` takes a name `old` holds: only when it ranks strictly higher (ties keep the first)."""
    return rank(new, prefer) < rank(old, prefer)


def conflict_warning(shadow: Shadowed, prefer: frozenset[str]) -> str | None:
    """The one line a name conflict prints, or None when the user's preference decided it."""
    kept, dropped = shadow.kept, shadow.dropped
    if rank(kept, prefer) == 0 and rank(dropped, prefer) != 0:
        return None
    who = f"plugin {dropped.plugin!r} (package {dropped.package})"
    if kept.builtin:
        return (f"{who} registers {shadow.name}, which bestiary has built in: using the built-in; "
                f"set {PREFER_ENV}={dropped.package} to use the plugin's")
    return (f"{who} registers {shadow.name}, as plugin {kept.plugin!r} (package {kept.package}) does: using "
            f"{kept.package}'s, loaded first; set {PREFER_ENV}={dropped.package} to use the other")


def claim_warning(hf_architecture: str, plugin_spec: str, plugin: Origin, builtin_spec: str) -> str:
    """The line for a third-party spec claiming an HF architecture a built-in spec also reads."""
    return (f"plugin {plugin.plugin!r} (package {plugin.package}) architecture {plugin_spec} claims HF "
            f"{hf_architecture}, which built-in {builtin_spec} reads: sources naming it convert as "
            f"{builtin_spec}; set {PREFER_ENV}={plugin.package} (or --architecture {plugin_spec}) for the plugin's")


def other_rank() -> bool:
    """This process is rank > 0 of a multi-rank engine (spawned `bestiary-rank{r}` or torchrun RANK), whose
    rank 0 has printed the same registry's warnings already."""
    import multiprocessing

    return multiprocessing.current_process().name.startswith("bestiary-rank") or os.environ.get("RANK", "0") != "0"


def warn(line: str) -> None:
    """One line on stderr, `bestiary: warning: ...` (no traceback, no Python warnings machinery), from rank 0 only."""
    if not other_rank():
        sys.stderr.write(f"bestiary: warning: {line}\n")
