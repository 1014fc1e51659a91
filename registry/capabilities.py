"""What an architecture supports, as `bestiary list` shows it and as convert enforces it.

`refusal(spec, ...)` names the first requested option the spec's `Supports` rules out; convert
(and `convert --dry_run`) call `check_supported` right after choosing the architecture, so an
unsupported combination is refused before any weight is read. Nothing here imports torch.
"""

from __future__ import annotations

from bestiary.core.format.errors import BestiaryError
from bestiary.registry.spec import ArchitectureSpec

# The QuantAlgo / KVCacheQuantAlgo values (core.format.config), for an empty `Supports` field.
ALL_QUANT_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W4A16_GPTQ", "FP8", "W8A8_SQ_PER_CHANNEL")
ALL_KV_CACHE_QUANT_ALGOS = ("FP8", "INT8")


def quant_algos(spec: ArchitectureSpec) -> tuple[str, ...]:
    """Weight quantization algorithms `spec` takes (all of bestiary's when it declares none)."""
    return spec.supports.quant_algos or ALL_QUANT_ALGOS


def kv_cache_quant_algos(spec: ArchitectureSpec) -> tuple[str, ...]:
    """KV cache quantization algorithms `spec` takes (all of bestiary's when it declares none; none at all
    with kv_cache_quantization False)."""
    if not spec.supports.kv_cache_quantization:
        return ()
    return spec.supports.kv_cache_quant_algos or ALL_KV_CACHE_QUANT_ALGOS


def sources(spec: ArchitectureSpec) -> tuple[str, ...]:
    """Source formats: HF directories / .safetensors / .bin / .pth always, GGUF when the spec claims a
    GGUF general.architecture."""
    return ("hf", "gguf") if spec.gguf_architectures else ("hf",)


def refusal(spec: ArchitectureSpec, tp_size: int = 1, pp_size: int = 1, quant_algo: str | None = None,
            kv_cache_quant_algo: str | None = None, moe_ep_size: int = 1) -> str | None:
    """Why `spec` cannot be converted with these options (one line naming the flag), or None."""
    s = spec.supports
    if tp_size > 1 and not s.tensor_parallel:
        return f"--tp_size {tp_size}: {spec.name} does not support tensor parallelism"
    if pp_size > 1 and not s.pipeline_parallel:
        return f"--pp_size {pp_size}: {spec.name} does not support pipeline parallelism"
    if moe_ep_size > 1 and not s.expert_parallel:
        return (f"--moe_ep_size {moe_ep_size}: {spec.name} has no experts to spread "
                "(expert parallelism is for MoE models)")
    if quant_algo and quant_algo not in quant_algos(spec):
        return f"quantization {quant_algo}: {spec.name} supports {', '.join(quant_algos(spec))}"
    if kv_cache_quant_algo and kv_cache_quant_algo not in kv_cache_quant_algos(spec):
        flag = f"--{kv_cache_quant_algo.lower()}_kv_cache"
        if not kv_cache_quant_algos(spec):
            return f"{flag}: {spec.name} takes no KV cache quantization (its cache is not plain K / V)"
        return f"{flag}: {spec.name} supports KV cache quantization {', '.join(kv_cache_quant_algos(spec))}"
    return None


def check_supported(spec: ArchitectureSpec, tp_size: int = 1, pp_size: int = 1, quant_algo: str | None = None,
                    kv_cache_quant_algo: str | None = None, moe_ep_size: int = 1) -> None:
    """BestiaryError when `refusal` finds an unsupported option."""
    reason = refusal(spec, tp_size, pp_size, quant_algo, kv_cache_quant_algo, moe_ep_size)
    if reason:
        raise BestiaryError(reason)


def columns(spec: ArchitectureSpec) -> dict[str, str]:
    """The capability cells of `bestiary list` for one architecture."""
    s = spec.supports
    yes = {True: "yes", False: "-"}
    out = {"TP": yes[s.tensor_parallel], "PP": yes[s.pipeline_parallel], "EP": yes[s.expert_parallel],
           "quant": "all" if not s.quant_algos else ", ".join(s.quant_algos),
           "KV quant": "-" if not s.kv_cache_quantization else ", ".join(s.kv_cache_quant_algos) or "all",
           "sources": ", ".join(sources(spec))}
    if s.lora_modules:
        out["LoRA"] = ", ".join(s.lora_modules)
    return out
