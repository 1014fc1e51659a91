"""bestiary.registry: the architecture registry and the spec plugins register."""

from bestiary.registry.registry import DuplicateArchitectureError, Registry, default_registry
from bestiary.registry.spec import ArchitectureSpec, LoraTargets, Supports, resolve

__all__ = [
    "ArchitectureSpec", "DuplicateArchitectureError", "LoraTargets", "Registry", "Supports", "default_registry", "resolve",
]
