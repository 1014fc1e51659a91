"""Named logits processors registered by plugins (hook `bestiary_register_logits_processors`).

`collect_logits_processors` calls every plugin's hook and returns name -> `NamedProcessor`; a bad
registration (a name that is not a word, a factory that is not callable, a name given twice) is that
plugin's one-line failure, and the other plugins keep working. What a factory and a processor take
and return is stated in `bestiary.plugins.hookspecs.bestiary_register_logits_processors`; the runtime
builds them per request (bestiary.core.runtime.plugin_processors).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bestiary.core.format.errors import BestiaryError
from bestiary.plugins.manager import LoadedPlugins, PluginFailure

HOOK = "bestiary_register_logits_processors"
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


@dataclass(frozen=True)
class NamedProcessor:
    """A processor factory and the distribution that registered it."""

    name: str
    factory: Callable[..., Any]
    package: str


class ProcessorRegistrationError(BestiaryError):
    """A plugin registered a logits processor wrongly (recorded as that plugin's failure)."""


def _checked(name: object, factory: object) -> str:
    """The name, if `register(name, factory)` was called right; else ProcessorRegistrationError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ProcessorRegistrationError(f"logits processor name {name!r}: expected 1-100 letters, digits or _.:-")
    if not callable(factory):
        raise ProcessorRegistrationError(f"logits processor {name!r}: factory {factory!r} is not callable")
    return name


def collect_logits_processors(plugins: LoadedPlugins, override: frozenset[str],
                              failures: list[PluginFailure]) -> dict[str, NamedProcessor]:
    """name -> NamedProcessor over every plugin's hook (appending to `failures`). A name already held is
    an error of the second plugin, unless that plugin is in `override` (a package under test): it replaces."""
    out: dict[str, NamedProcessor] = {}
    for plugin_name, plugin in plugins.manager.list_name_plugin():
        hook = getattr(plugin, HOOK, None)
        if hook is None:
            continue
        package = plugins.packages.get(plugin_name, plugin_name)
        mine: dict[str, NamedProcessor] = {}

        def register(name: object, factory: object, _package: str = package,
                     _mine: dict[str, NamedProcessor] = mine) -> None:
            key = _checked(name, factory)
            if key in _mine:
                raise ProcessorRegistrationError(f"logits processor {key!r} is registered twice by {_package!r}")
            _mine[key] = NamedProcessor(key, factory, _package)  # type: ignore[arg-type]  # checked callable

        try:
            hook(register=register)
        except ProcessorRegistrationError as err:
            failures.append(PluginFailure(plugin_name, package, str(err)))
            continue
        except Exception:  # noqa: BLE001 - a broken plugin is reported, the rest keep working
            failures.append(PluginFailure(plugin_name, package, traceback.format_exc()))
            continue
        for key, named in mine.items():
            if key in out and plugin_name not in override:
                failures.append(PluginFailure(plugin_name, package, f"logits processor {key!r} is registered "
                                              f"twice: by {out[key].package!r} and by {package!r}"))
                continue
            out[key] = named
    return out
