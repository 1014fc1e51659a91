"""bestiary.core.cli: the `bestiary` command line (`main`), its handlers and the demo.

Handlers import what they run inside themselves, so `--help` starts fast. Nothing imports cli.

Layer 7 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime, convert, bench, serve.
"""

from __future__ import annotations

from bestiary.core.cli.main import main

__all__ = ["main"]
