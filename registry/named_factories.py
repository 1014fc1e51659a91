"""Named factories registered by plugins: logits processors (hook `bestiary_register_logits_processors`)
and grammar backends (hook `bestiary_register_grammar_backends`).

`collect_named` calls every plugin's hook and returns name -> `NamedFactory`; a bad registration (a
name that is not a word, a factory that is not callable, a name given twice) is that plugin's one-line
failure, and the other plugins keep working. What each factory takes and returns is stated in
`bestiary.plugins.hookspecs`; the runtime builds processors per request
(bestiary.core.runtime.plugin_processors) and backends per engine (bestiary.core.runtime.guided).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bestiary.core.format.errors import BestiaryError
from bestiary.plugins.manager import LoadedPlugins, PluginFailure

PROCESSORS = ("bestiary_register_logits_processors", "logits processor")  # (hook, what it registers)
GRAMMAR_BACKENDS = ("bestiary_register_grammar_backends", "grammar backend")
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


@dataclass(frozen=True)
class NamedFactory:
    """A factory (of a logits processor or a grammar backend) and the distribution that registered it."""

    name: str
    factory: Callable[..., Any]
    package: str


class RegistrationError(BestiaryError):
    """A plugin registered a factory wrongly (recorded as that plugin's failure)."""


def _checked(name: object, factory: object, what: str) -> str:
    """The name, if `register(name, factory)` was called right; else RegistrationError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RegistrationError(f"{what} name {name!r}: expected 1-100 letters, digits or _.:-")
    if not callable(factory):
        raise RegistrationError(f"{what} {name!r}: factory {factory!r} is not callable")
    return name


def collect_named(plugins: LoadedPlugins, override: frozenset[str], failures: list[PluginFailure],
                  kind: tuple[str, str]) -> dict[str, NamedFactory]:
    """name -> NamedFactory over every plugin's hook kind = (hook name, what it registers), appending to
    `failures`. A name already held is an error of the second plugin, unless that plugin is in `override`
    (a package under test): it replaces."""
    hook_name, what = kind
    out: dict[str, NamedFactory] = {}
    for plugin_name, plugin in plugins.manager.list_name_plugin():
        hook = getattr(plugin, hook_name, None)
        if hook is None:
            continue
        package = plugins.packages.get(plugin_name, plugin_name)
        mine: dict[str, NamedFactory] = {}

        def register(name: object, factory: object, _package: str = package,
                     _mine: dict[str, NamedFactory] = mine) -> None:
            key = _checked(name, factory, what)
            if key in _mine:
                raise RegistrationError(f"{what} {key!r} is registered twice by {_package!r}")
            _mine[key] = NamedFactory(key, factory, _package)  # type: ignore[arg-type]  # checked callable

        try:
            hook(register=register)
        except RegistrationError as err:
            failures.append(PluginFailure(plugin_name, package, str(err)))
            continue
        except Exception:  # noqa: BLE001 - a broken plugin is reported, the rest keep working
            failures.append(PluginFailure(plugin_name, package, traceback.format_exc()))
            continue
        for key, named in mine.items():
            if key in out and plugin_name not in override:
                failures.append(PluginFailure(plugin_name, package, f"{what} {key!r} is registered "
                                              f"twice: by {out[key].package!r} and by {package!r}"))
                continue
            out[key] = named
    return out
