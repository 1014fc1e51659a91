"""bestiary.plugins: hook specs, markers and the plugin manager.

Architecture packages import `hookimpl` from here:

    from bestiary.plugins import hookimpl

    @hookimpl
    def bestiary_register_architectures(register):
        register(ArchitectureSpec(...))

Layer 1 of the core (docs/architecture.md). May import: format.
"""

from bestiary.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl, hookspec

__all__ = ["ENTRY_POINT_GROUP", "hookimpl", "hookspec"]
