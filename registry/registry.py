"""The architecture registry: name / HF architecture / model_type -> ArchitectureSpec.

Two plugins registering one name never stop start-up: registry.name_policy decides (a built-in wins
over a third-party plugin, with a one-line warning, unless BESTIARY_PREFER_PLUGINS names the plugin).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from types import ModuleType
from typing import Any

from bestiary.core.format.errors import BestiaryError, PluginError
from bestiary.plugins.manager import LoadedPlugins, PluginFailure, build_plugin_manager
from bestiary.registry.name_policy import (
    Origin,
    Shadowed,
    claim_warning,
    conflict_warning,
    new_wins,
    preferred_plugins,
    rank,
    warn,
)
from bestiary.registry.named_factories import GRAMMAR_BACKENDS, PROCESSORS, NamedFactory, collect_named
from bestiary.registry.spec import ArchitectureSpec, check_reference


class DuplicateArchitectureError(BestiaryError):
    """A name registered twice where no policy decides: `Registry.register` called directly, or one
    plugin registering a name twice (recorded as that plugin's failure)."""


class Registry:
    """Architectures registered by the loaded plugins."""

    def __init__(self, plugins: LoadedPlugins, override: frozenset[str] = frozenset(),
                 prefer: frozenset[str] | None = None) -> None:
        self.plugins = plugins
        self.specs: dict[str, ArchitectureSpec] = {}
        self.override = override  # plugin names whose specs replace an earlier spec of the same name
        self.prefer = preferred_plugins() if prefer is None else prefer  # BESTIARY_PREFER_PLUGINS
        self.origins: dict[str, Origin] = {}  # architecture name -> the plugin that registered it
        self.shadowed: list[Shadowed] = []  # specs set aside by the name policy (registry.name_policy)
        self.failures: list[PluginFailure] = list(plugins.failures)
        self._collect()
        self._warn_claims()
        # named logits processors (hook bestiary_register_logits_processors; core.runtime.plugin_processors)
        # and grammar backends (hook bestiary_register_grammar_backends; core.runtime.guided)
        self.logits_processors: dict[str, NamedFactory] = collect_named(plugins, override, self.failures, PROCESSORS)
        self.grammar_backends: dict[str, NamedFactory] = collect_named(plugins, override, self.failures,
                                                                       GRAMMAR_BACKENDS)

    @classmethod
    def from_plugins(
        cls, extra_plugins: dict[str, ModuleType | object] | None = None, override: bool = False,
        prefer: frozenset[str] | None = None,
    ) -> Registry:
        """A registry over every installed plugin plus `extra_plugins` (name -> plugin).

        override: the extra plugins' specs replace installed ones of the same name whatever the
        name policy says (a plugin package under test, bestiary.testing). prefer: the plugins
        (distributions or entry-point names) that win a name (default: BESTIARY_PREFER_PLUGINS)."""
        return cls(build_plugin_manager(extra_plugins), frozenset(extra_plugins or ()) if override else frozenset(),
                   prefer)

    def _collect(self) -> None:
        manager = self.plugins.manager
        for name, plugin in manager.list_name_plugin():
            hook = getattr(plugin, "bestiary_register_architectures", None)
            if hook is None:
                continue
            package = self.plugins.packages.get(name, name)
            origin, override = Origin(name, package), name in self.override
            try:
                hook(register=lambda spec, _o=origin, _w=override: self._offer(spec, _o, _w))
            except (PluginError, DuplicateArchitectureError) as err:  # a bad reference, a name given twice
                self.failures.append(PluginFailure(name, package, str(err)))
            except Exception:  # noqa: BLE001 - a broken plugin is reported, the rest keep working
                import traceback

                self.failures.append(PluginFailure(name, package, traceback.format_exc()))

    def register(self, spec: ArchitectureSpec, package: str = "", override: bool = False) -> None:
        """Add `spec`; a second spec with the same name is an error naming both packages (unless
        `override`: it replaces the first), and so is a lazy reference that does not resolve
        (PluginError, checked without importing)."""
        if not isinstance(spec, ArchitectureSpec):
            raise TypeError(f"register() expects an ArchitectureSpec, got {type(spec).__name__}")
        spec = dataclasses.replace(spec, package=package or spec.package)
        if spec.name in self.specs and not override:
            other = self.specs[spec.name].package
            raise DuplicateArchitectureError(
                f"architecture {spec.name!r} is registered twice: by {other!r} and by {spec.package!r}"
            )
        for field_name, ref in spec.references().items():
            try:
                check_reference(ref)
            except PluginError as err:
                where = f"architecture {spec.name!r} (package {spec.package or '?'})"
                raise PluginError(f"{where}: {field_name}: {err}") from None
        self.specs[spec.name] = spec

    def _offer(self, spec: ArchitectureSpec, origin: Origin, override: bool) -> None:
        """register() under the name policy: a name already held goes to the higher-ranked plugin
        (registry.name_policy), the other spec is set aside in `shadowed` with a warning line."""
        if not isinstance(spec, ArchitectureSpec):
            raise TypeError(f"register() expects an ArchitectureSpec, got {type(spec).__name__}")
        old = self.origins.get(spec.name, Origin("?", self.specs[spec.name].package)) \
            if spec.name in self.specs else None
        if old == origin:
            raise DuplicateArchitectureError(f"architecture {spec.name!r} is registered twice by {origin.package!r}")
        if old is None or override or new_wins(old, origin, self.prefer):
            self.register(spec, origin.package, override=True)
            self.origins[spec.name] = origin
            if old is None or override:
                return
            shadow = Shadowed(spec.name, kept=origin, dropped=old)
        else:
            shadow = Shadowed(spec.name, kept=old, dropped=origin)
        self.shadowed.append(shadow)
        line = conflict_warning(shadow, self.prefer)
        if line:
            warn(line)

    def _warn_claims(self) -> None:
        """Warn once per third-party spec claiming an HF architecture that a built-in spec of another
        name reads (lookups rank the built-in first unless the plugin is preferred)."""
        builtin = {arch: spec.name for spec in self._ranked() if self._origin(spec).builtin
                   for arch in (spec.name, *spec.hf_architectures)}
        for spec in self.specs.values():
            origin = self._origin(spec)
            if origin.builtin or rank(origin, self.prefer) == 0:
                continue
            for arch in spec.hf_architectures:
                if builtin.get(arch, spec.name) != spec.name:
                    warn(claim_warning(arch, spec.name, origin, builtin[arch]))

    def _origin(self, spec: ArchitectureSpec) -> Origin:
        return self.origins.get(spec.name, Origin("?", spec.package))

    def _ranked(self) -> list[ArchitectureSpec]:
        """The specs in lookup order: preferred plugins', then built-ins', then the others' (each in
        registration order)."""
        return sorted(self.specs.values(), key=lambda spec: rank(self._origin(spec), self.prefer))

    def names(self) -> list[str]:
        """Registered architecture names, sorted."""
        return sorted(self.specs)

    def get(self, name: str) -> ArchitectureSpec:
        """The spec called `name` (or claiming HF architecture `name`); error lists the registered ones."""
        if name in self.specs:
            return self.specs[name]
        for spec in self._ranked():
            if name in spec.hf_architectures:
                return spec
        raise BestiaryError(f"unknown architecture {name!r}; registered: {', '.join(self.names()) or 'none'}"
                            + self._failures_note())

    def for_hf_config(self, hf_config: dict[str, Any], source: str, override: str | None = None) -> ArchitectureSpec:
        """The spec that handles an HF config dict read from `source`.

        Order: `override` (--architecture), then the claim hook, then HF `architectures`,
        then `model_type`; among the specs that claim one entry, the name policy's rank (a preferred
        plugin, then a built-in, then the others).
        """
        if override:
            return self.get(override)
        claims = [c for c in self.plugins.manager.hook.bestiary_claim_hf_config(hf_config=hf_config) if c]
        unique = sorted(set(claims))
        if len(unique) > 1:
            raise BestiaryError(
                f"{source}: architectures {' and '.join(repr(c) for c in unique)} both claim this config; "
                "pick one with --architecture"
            )
        if unique:
            return self.get(unique[0])
        wanted = list(hf_config.get("architectures") or [])
        ranked = self._ranked()
        for arch in wanted:
            for spec in ranked:
                if arch == spec.name or arch in spec.hf_architectures:
                    return spec
        model_type = hf_config.get("model_type")
        for spec in ranked:
            if model_type and model_type in spec.hf_model_types:
                return spec
        what = ", ".join(wanted) or f"model_type {model_type!r}"
        raise BestiaryError(
            f"{source}: unknown architecture {what}; registered: {', '.join(self.names()) or 'none'}"
            + self._failures_note()
        )

    def logits_processor(self, name: str) -> NamedFactory:
        """The processor registered as `name`; an unknown name is one line listing the registered ones."""
        if name in self.logits_processors:
            return self.logits_processors[name]
        raise BestiaryError(f"logits_processors: unknown processor {name!r}; registered: "
                            f"{', '.join(sorted(self.logits_processors)) or 'none'}" + self._failures_note())

    def grammar_backend(self, name: str) -> NamedFactory:
        """The grammar backend registered as `name`; an unknown name is one line listing the registered ones."""
        if name in self.grammar_backends:
            return self.grammar_backends[name]
        raise BestiaryError(f"guided backend {name!r}: not a registered grammar backend; registered: "
                            f"{', '.join(['llguidance', *sorted(self.grammar_backends)])}" + self._failures_note())

    def _failures_note(self) -> str:
        """'; plugin X failed to load: <last line>' for each broken plugin (it may have been the one)."""
        return "".join(f"; plugin {f.name!r} failed to load: {f.traceback.strip().splitlines()[-1]}"
                       for f in self.failures)


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry of every installed plugin, built once per process."""
    return Registry.from_plugins()
