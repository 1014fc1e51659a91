"""bestiary: a plugin-based LLM model zoo and inference engine.

The heavy parts (torch, the executor) load on first use, so `bestiary --help` and
`bestiary list` start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoraRequest", "SamplingConfig", "__version__"]

if TYPE_CHECKING:
    from bestiary.core.lora.request import LoraRequest
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig


def __getattr__(name: str) -> Any:
    """Lazy top-level exports: `from bestiary import LLM, SamplingConfig`."""
    if name == "LLM":
        from bestiary.core.runtime.llm import LLM

        return LLM
    if name == "LoraRequest":
        from bestiary.core.lora.request import LoraRequest

        return LoraRequest
    if name == "SamplingConfig":
        from bestiary.core.runtime.sampling import SamplingConfig

        return SamplingConfig
    raise AttributeError(f"module 'bestiary' has no attribute {name!r}")
