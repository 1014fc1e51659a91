"""bestiary.registry: the architecture registry and the spec plugins register.

Layer 2 of the core (docs/architecture.md). May import: format, plugins, sources, kernels.
"""

from bestiary.registry.registry import DuplicateArchitectureError, Registry, default_registry
from bestiary.registry.spec import (
    DEFAULT_KEY_MAP,
    ArchitectureSpec,
    LoraTargets,
    PerExpert,
    Supports,
    resolve,
)

__all__ = [
    "DEFAULT_KEY_MAP", "ArchitectureSpec", "DuplicateArchitectureError", "LoraTargets", "PerExpert", "Registry",
    "Supports", "default_registry", "resolve",
]
