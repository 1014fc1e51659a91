"""Building the plugin manager: built-ins and third-party packages through entry points.

A plugin that fails to import or register is recorded as a `PluginFailure` (with its own
traceback) and the other plugins keep working.
"""

from __future__ import annotations

import importlib.metadata
import traceback
from dataclasses import dataclass
from types import ModuleType

import pluggy

from bestiary.plugins import hookspecs


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded: its entry-point name, distribution and traceback."""

    name: str
    package: str
    traceback: str


@dataclass
class LoadedPlugins:
    """The manager plus where each plugin came from and which ones failed."""

    manager: pluggy.PluginManager
    packages: dict[str, str]  # plugin name -> distribution name
    failures: list[PluginFailure]


def _distribution_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "?"


def build_plugin_manager(extra_plugins: dict[str, ModuleType | object] | None = None) -> LoadedPlugins:
    """A fresh manager with every `bestiary.architectures` entry point (and `extra_plugins`).

    extra_plugins: name -> plugin object, registered after the entry points (for tests
    and for programs embedding bestiary with their own architectures).
    """
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    packages: dict[str, str] = {}
    failures: list[PluginFailure] = []
    seen: set[tuple[str, str]] = set()
    for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        package = _distribution_name(ep)
        if (package, ep.name) in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add((package, ep.name))
        # another distribution's entry point of the same name (a third-party `qwen3` beside the built-in) is
        # loaded too, under "package:name": registry.name_policy decides between their architectures
        name = ep.name if ep.name not in packages else f"{package}:{ep.name}"
        try:
            manager.register(ep.load(), name=name)
        except Exception:  # noqa: BLE001 - a broken plugin must not take the others down
            failures.append(PluginFailure(name, package, traceback.format_exc()))
            continue
        packages[name] = package
    for name, plugin in (extra_plugins or {}).items():
        manager.register(plugin, name=name)
        packages[name] = getattr(plugin, "__name__", name)
    return LoadedPlugins(manager, packages, failures)
