"""bestiary.core.convert: sources -> checkpoint dir -> engine dir.

- `loader`: key maps, rank slices, strict loading (and the hook markers plugins use:
  `slices_itself`, `Target`).
- `postprocess`: shared postprocess hooks (`transposes_source`, ...).
- `source_to_checkpoint`: `bestiary convert` (`convert`, `instantiate`, `rank_writer`).
- `checkpoint_to_engine`: `bestiary build` (`build_engine`).

Imports: format, sources, quant, layers, kernels, runtime.model / runtime.engine (to
instantiate and check), registry, plugins; never cli.

`from bestiary.core.convert import convert` keeps working (names resolved on first use, so
importing `bestiary.core.convert.loader` stays light).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {"convert", "instantiate", "rank_writer"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        from bestiary.core.convert import source_to_checkpoint

        return getattr(source_to_checkpoint, name)
    raise AttributeError(f"module 'bestiary.core.convert' has no attribute {name!r}")
