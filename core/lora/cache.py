"""The two-level LoRA cache of one model rank (TensorRT-LLM, "LoraCache configuration").

    host level    task id -> LoraSource: the adapter as its first request brought it (every
                  rank's weights, in the model's dtype), within host_cache_size bytes;
    device level  task id -> LoraAdapter: placed on this rank, ready to run (cut to the rank,
                  postprocessed, on the model's device), within its own budget: device_cache_size
                  bytes, or on CUDA by default device_cache_percent of the free memory after load.

`take(request)`, when a request arrives:
  1. an id not cached whose request brings weights (a PEFT dir, or TensorRT-LLM's weights + config)
     or that the engine bundles: read and check them, insert the source in the host level;
  2. an id alone that is not cached (nor bundled): a one-line error for this request only;
  3. place the source on the rank unless the device level has it, insert it there;
  4. hold the id (a count); the caller (the executor) releases it when the request ends.
Inserting into a level first evicts that level's least recently used ids that nobody holds,
until the new entry fits; if only held ids are left, the request is refused (one line). Held
ids are never evicted from either level, so a running request's adapter stays in place.
`check_accounting()` is the invariant for tests: each level's byte count is the sum of its
entries and within its budget; every held id is in both levels.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch
from pydantic import BaseModel, Field

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.adapter import LoraAdapter, LoraSource, module_dims, place, read_peft
from bestiary.core.lora.bundle import LoraBuildConfig
from bestiary.core.lora.request import LoraRequest
from bestiary.core.lora.trtllm_tensors import read_rows
from bestiary.registry import Registry, default_registry

MiB = 1 << 20


class LoraCacheConfig(BaseModel):
    """Sizes of the two levels (TensorRT-LLM's PeftCacheConfig names)."""

    host_cache_size: int = Field(1 << 30, ge=1, description="Host level budget in bytes.")
    device_cache_size: int | None = Field(
        None, ge=1, description="Device level budget in bytes (default: on CUDA device_cache_percent of the free "
                                "memory after load, on the CPU host_cache_size).")
    device_cache_percent: float = Field(0.02, gt=0, le=1, description="CUDA: share of free memory for the device level.")


def adapter_nbytes(adapter: LoraAdapter) -> int:
    """Bytes of a placed adapter's pieces."""
    return sum(p.a.nbytes + p.b.nbytes for ps in adapter.pieces.values() for p in ps)


def _mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB"


E = TypeVar("E")


class _Level(Generic[E]):
    """One level: id -> (entry, bytes) in LRU order (most recent last), within `budget` bytes."""

    def __init__(self, name: str, budget: int) -> None:
        self.name, self.budget = name, budget
        self.entries: OrderedDict[str, tuple[E, int]] = OrderedDict()
        self.used = 0

    def get(self, key: str) -> E | None:
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key][0]

    def insert(self, key: str, entry: E, size: int, held: Counter[str],
               on_evict: Callable[[str], None] | None = None) -> None:
        """Insert, evicting unheld ids least recently used first; refuse when held ones fill it."""
        if size > self.budget:
            raise BestiaryError(f"LoRA task {key!r}: needs {_mib(size)}, more than the {self.name} cache's "
                                f"{_mib(self.budget)} ({self.name}_cache_size)")
        for victim in [k for k in self.entries if not held[k]]:
            if self.used + size <= self.budget:
                break
            self.remove(victim)
            if on_evict is not None:
                on_evict(victim)
        if self.used + size > self.budget:
            busy = sum(1 for k in self.entries if held[k])
            raise BestiaryError(f"LoRA task {key!r}: the {self.name} cache is full ({busy} adapters in use hold "
                                f"{_mib(self.used)} of {_mib(self.budget)}); it needs {_mib(size)}: retry when "
                                "requests finish or raise the budget")
        self.entries[key] = (entry, size)
        self.used += size

    def remove(self, key: str) -> None:
        _, size = self.entries.pop(key)
        self.used -= size


class LoraCache:
    """The two levels for `model` (one rank); `bundled`: task id -> an engine's TensorRT-LLM LoRA tensor file;
    `limits`: the engine's --max_lora_rank / --lora_target_modules, which every adapter must keep to."""

    def __init__(self, model, registry: Registry | None = None, config: LoraCacheConfig | None = None,
                 bundled: dict[str, Path] | None = None, limits: LoraBuildConfig | None = None) -> None:
        self.model, self.registry = model, registry or default_registry()
        self.config = config or LoraCacheConfig()
        self.bundled = dict(bundled or {})
        self.limits = limits
        self.host: _Level[LoraSource] = _Level("host", self.config.host_cache_size)
        self.device: _Level[LoraAdapter] = _Level("device", self._device_budget())
        self.held: Counter[str] = Counter()
        self.paths: dict[str, Path] = {}  # id -> the PEFT dir it was read from
        self._lock = threading.RLock()  # the asyncio API takes on the event loop, releases on its worker

    def _device_budget(self) -> int:
        if self.config.device_cache_size is not None:
            return self.config.device_cache_size
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(1, int(free * self.config.device_cache_percent))
        return self.config.host_cache_size

    @property
    def adapters(self) -> dict[str, LoraAdapter]:
        """The device level's adapters by id (least recently used first)."""
        return {k: e for k, (e, _) in self.device.entries.items()}

    # --- requests ----------------------------------------------------------------------
    def get(self, request: LoraRequest | None) -> LoraAdapter | None:
        """The ready adapter of `request` (None: the base model), cached; not held."""
        if request is None:
            return None
        if not isinstance(request, LoraRequest):
            raise BestiaryError(f"lora: expected a LoraRequest or None, got {type(request).__name__}")
        with self._lock:
            key = request.task_id
            source, placed = self._source(key, request)
            adapter = self.device.get(key)
            if adapter is None:
                adapter = placed or place(source, self.model, self.registry)
                self.device.insert(key, adapter, adapter_nbytes(adapter), self.held)
            return adapter

    def take(self, request: LoraRequest | None) -> LoraAdapter | None:
        """`get`, and hold the id until `release` (the executor's request ends)."""
        with self._lock:
            adapter = self.get(request)
            if adapter is not None:
                self.held[adapter.name] += 1
            return adapter

    def acquire(self, adapter: LoraAdapter) -> None:
        """Hold an already held id once more (another sample of the same request)."""
        with self._lock:
            self.held[adapter.name] += 1

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            if self.held[adapter.name] <= 0:
                raise AssertionError(f"LoRA task {adapter.name!r} released more often than taken")
            self.held[adapter.name] -= 1
            if not self.held[adapter.name]:
                del self.held[adapter.name]

    def _source(self, key: str, request: LoraRequest) -> tuple[LoraSource, LoraAdapter | None]:
        """The host level's source of `key`, read from what the request brings on a miss (with
        its placed adapter then: placing checks every shape)."""
        source = self.host.get(key)
        if source is not None:
            known = self.paths.get(key)
            if request.path is not None and (known is None or Path(request.path).resolve() != known.resolve()):
                where = f"from {known}" if known else "from tensors"
                raise BestiaryError(f"LoRA adapter {key!r} is already loaded {where}, not {request.path}: "
                                    "give another name")
            return source, None
        source = self._read(key, request)
        placed = place(source, self.model, self.registry)  # every shape checked now, not mid-batch
        self.host.insert(key, source, source.nbytes, self.held, on_evict=self._evicted)
        if request.path is not None:
            self.paths[key] = Path(request.path)
        return source, placed

    def _evicted(self, key: str) -> None:
        """A host eviction drops the id's device copy too (a later request brings new weights)."""
        self.paths.pop(key, None)
        if key in self.device.entries:
            self.device.remove(key)

    def _read(self, key: str, request: LoraRequest) -> LoraSource:
        model = self.model
        if request.path is not None:
            spec = self.registry.get(model.config.architecture)
            source = read_peft(request.path, spec, self.registry, model.config.num_hidden_layers, key)
        elif request.weights is not None or request.config is not None:
            if request.weights is None or request.config is None:
                raise BestiaryError(f"LoRA task {key!r}: give both weights and config (TensorRT-LLM's LoRA tensors)")
            source = read_rows(request.weights, request.config, lambda m, i: module_dims(model, m, i), key)
        elif key in self.bundled:
            source = self._read_bundled(key)
        else:
            raise BestiaryError(f"LoRA task {key!r} is not cached: its first request must bring the weights "
                                "(a PEFT path, or weights + config)")
        self._check_limits(key, source)
        return source.to(model.dtype)

    def _check_limits(self, key: str, source: LoraSource) -> None:
        """An adapter past the engine's max_lora_rank or lora_target_modules: one line."""
        if self.limits is None:
            return
        for m in source.modules:
            what = f"LoRA task {key!r}: {m.hf_path or m.where}"
            if m.rank > self.limits.max_lora_rank:
                raise BestiaryError(f"{what} has rank {m.rank}, above the engine's max_lora_rank {self.limits.max_lora_rank}")
            outside = [n for n in m.modules if n not in self.limits.lora_target_modules]
            if outside:
                raise BestiaryError(f"{what} adapts {outside[0]}, not in the engine's lora_target_modules "
                                    f"({', '.join(self.limits.lora_target_modules)})")

    def _read_bundled(self, key: str) -> LoraSource:
        from safetensors.torch import load_file

        tensors = load_file(str(self.bundled[key]))
        return read_rows(tensors["lora_weights"], tensors["lora_config"],
                         lambda m, i: module_dims(self.model, m, i), key)

    # --- tests -------------------------------------------------------------------------
    def check_accounting(self) -> None:
        """The invariant of the module docstring (AssertionError naming what broke)."""
        for level in (self.host, self.device):
            total = sum(size for _, size in level.entries.values())
            if total != level.used or level.used > level.budget:
                raise AssertionError(f"LoRA {level.name} cache: {level.used} bytes counted, {total} held in entries, "
                                     f"budget {level.budget}")
        for key in self.held:
            if key not in self.host.entries or key not in self.device.entries:
                raise AssertionError(f"LoRA task {key!r} is held but not in both cache levels")
