"""The architecture registry: name / HF architecture / model_type -> ArchitectureSpec."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from types import ModuleType
from typing import Any

from bestiary.core.format.errors import BestiaryError, PluginError
from bestiary.plugins.manager import LoadedPlugins, PluginFailure, build_plugin_manager
from bestiary.registry.spec import ArchitectureSpec, check_reference


class DuplicateArchitectureError(BestiaryError):
    """Two plugins registered the same architecture name."""


class Registry:
    """Architectures registered by the loaded plugins."""

    def __init__(self, plugins: LoadedPlugins, override: frozenset[str] = frozenset()) -> None:
        self.plugins = plugins
        self.specs: dict[str, ArchitectureSpec] = {}
        self.override = override  # plugin names whose specs replace an earlier spec of the same name
        self.failures: list[PluginFailure] = list(plugins.failures)
        self._collect()

    @classmethod
    def from_plugins(
        cls, extra_plugins: dict[str, ModuleType | object] | None = None, override: bool = False
    ) -> Registry:
        """A registry over every installed plugin plus `extra_plugins` (name -> plugin).

        override: the extra plugins' specs replace installed ones of the same name instead of
        being a DuplicateArchitectureError (a plugin package under test, bestiary.testing)."""
        return cls(build_plugin_manager(extra_plugins), frozenset(extra_plugins or ()) if override else frozenset())

    def _collect(self) -> None:
        manager = self.plugins.manager
        for name, plugin in manager.list_name_plugin():
            hook = getattr(plugin, "bestiary_register_architectures", None)
            if hook is None:
                continue
            package = self.plugins.packages.get(name, name)
            try:
                hook(register=lambda spec, _p=package, _o=name in self.override: self.register(spec, _p, _o))
            except DuplicateArchitectureError:
                raise
            except PluginError as err:  # a bad reference: its one line is the whole story
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

    def names(self) -> list[str]:
        """Registered architecture names, sorted."""
        return sorted(self.specs)

    def get(self, name: str) -> ArchitectureSpec:
        """The spec called `name` (or claiming HF architecture `name`); error lists the registered ones."""
        if name in self.specs:
            return self.specs[name]
        for spec in self.specs.values():
            if name in spec.hf_architectures:
                return spec
        raise BestiaryError(f"unknown architecture {name!r}; registered: {', '.join(self.names()) or 'none'}"
                            + self._failures_note())

    def for_hf_config(self, hf_config: dict[str, Any], source: str, override: str | None = None) -> ArchitectureSpec:
        """The spec that handles an HF config dict read from `source`.

        Order: `override` (--architecture), then the claim hook, then HF `architectures`,
        then `model_type`.
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
        for arch in wanted:
            for spec in self.specs.values():
                if arch == spec.name or arch in spec.hf_architectures:
                    return spec
        model_type = hf_config.get("model_type")
        for spec in self.specs.values():
            if model_type and model_type in spec.hf_model_types:
                return spec
        what = ", ".join(wanted) or f"model_type {model_type!r}"
        raise BestiaryError(
            f"{source}: unknown architecture {what}; registered: {', '.join(self.names()) or 'none'}"
            + self._failures_note()
        )

    def _failures_note(self) -> str:
        """'; plugin X failed to load: <last line>' for each broken plugin (it may have been the one)."""
        return "".join(f"; plugin {f.name!r} failed to load: {f.traceback.strip().splitlines()[-1]}"
                       for f in self.failures)


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry of every installed plugin, built once per process."""
    return Registry.from_plugins()
