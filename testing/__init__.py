"""bestiary.testing: the conformance kit for architecture plugins (and the parity helpers).

One line in a plugin's test module runs the whole suite, parametrized over the given tiny configs:

    from bestiary.testing import conformance

    TestQwen2 = conformance("Qwen2ForCausalLM", {"gqa": dict(model_type="qwen2", vocab_size=96, hidden_size=64,
                            intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)})

`suite.py` has the tests (logits parity, greedy, broken positions, TP/PP reassembly,
strict keys, quantized smoke, compiled CPU decode plan, the convert linter), `references.py`
the ground truths (an HF transformers model, or plain functions for families transformers
lacks), `local_plugins.py` the registry of a plugin that is not pip-installed (read from its
directory's pyproject.toml), `parity.py` the helpers, `plugin.py` the pytest plugin.

Importing this package imports neither torch, transformers nor pytest (the pytest plugin loads
it at start-up); the names below resolve on first use.

Layer 7 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime, convert, bench, serve.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "conformance": "bestiary.testing.suite",
    "Case": "bestiary.testing.suite",
    "HFReference": "bestiary.testing.references",
    "FunctionReference": "bestiary.testing.references",
    "local_registry": "bestiary.testing.local_plugins",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bestiary.testing' has no attribute {name!r}")
