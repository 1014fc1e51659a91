"""bestiary.core: the engine, one package per stage of the data flow.

    sources/ -> convert/ -> format/ (checkpoint dir) -> convert/ (build) -> format/ (engine dir)
             -> runtime/ (engine, model, executor) -> cli/

- `format/`   what both sides share: config schemas, build config, checkpoint and engine
              read/write, errors, cache paths, progress bars. Imports nothing else of bestiary.
- `sources/`  reading model files (HF dirs, .safetensors/.bin/.pth, GGUF): weights and tokenizers.
- `convert/`  loader (key maps, rank slices), postprocess hooks, `bestiary convert` and `bestiary build`.
- `runtime/`  model, engine loading, executor, paged KV cache, sampling, beam search, tokenizer,
              the Python API (`LLM`), evaluation.
- `serve/`    the OpenAI-compatible HTTP server on the runtime's asyncio API (`bestiary serve`).
- `cli/`      the `bestiary` command line (nothing else imports it).
- `layers/`, `kernels/`, `cpu/`, `quant/`: the building blocks the model is made of, their
              Triton / torch / compiled C kernels, quantization (both sides).

Each package's docstring states what it may import; tests/test_layout.py enforces it.

Module paths from before this layout (`bestiary.core.config`, `bestiary.core.model`, ...) stay
importable as aliases of the moved modules (same module object), so plugins written against
them keep working; `MOVED` lists them. New code uses the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

# old module path -> its home in this layout
MOVED: dict[str, str] = {
    "bestiary.core.config": "bestiary.core.format.config",
    "bestiary.core.build_config": "bestiary.core.format.build_config",
    "bestiary.core.checkpoint": "bestiary.core.format.checkpoint",
    "bestiary.core.errors": "bestiary.core.format.errors",
    "bestiary.core.cache": "bestiary.core.format.cache",
    "bestiary.core.progress": "bestiary.core.format.progress",
    "bestiary.core.loader": "bestiary.core.convert.loader",
    "bestiary.core.postprocess": "bestiary.core.convert.postprocess",
    "bestiary.core.build": "bestiary.core.convert.checkpoint_to_engine",
    "bestiary.core.model": "bestiary.core.runtime.model",
    "bestiary.core.engine": "bestiary.core.runtime.engine",
    "bestiary.core.executor": "bestiary.core.runtime.executor",
    "bestiary.core.kv_cache": "bestiary.core.runtime.kv_cache",
    "bestiary.core.sampling": "bestiary.core.runtime.sampling",
    "bestiary.core.logits_processors": "bestiary.core.runtime.logits_processors",
    "bestiary.core.beam": "bestiary.core.runtime.beam",
    "bestiary.core.tokenizer": "bestiary.core.runtime.tokenizer",
    "bestiary.core.llm": "bestiary.core.runtime.llm",
    "bestiary.core.evaluate": "bestiary.core.runtime.evaluate",
    "bestiary.core.commands": "bestiary.core.cli.commands",
    "bestiary.core.demo": "bestiary.core.cli.demo",
}
# `bestiary.core.convert` and `bestiary.core.cli` are now the stage packages; they export the
# names their old modules were imported for (convert / instantiate / rank_writer, main).


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to the moved module itself (one module object, two names)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the moved module was executed under its new name."""


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
