"""Running a multi-rank engine: rank 0 drives, every rank runs the same model step on its shard.

Rank 0 (the driver) owns the executor, scheduler, sampling and tokenizer. Every forward of
its model is preceded by one control message to all ranks (core.runtime.worker_group's
gloo control group), so all ranks enter the step's collectives together:

    driver  model(ids, meta, kv)  ->  broadcast Step(engine, kv pool, ids, meta, copies)
                                  ->  its own forward: all-reduce / all-gather with the ranks
    rank r  receive Step          ->  apply the KV block copies rank 0 made since the last step
                                  ->  the same forward on its shard and its own KV pool

Messages: Load (engine dir: each rank loads only its rank file; errors gathered back),
Step, Release (an engine no longer used) and None (exit). A rank's KV pool mirrors the
driver's pool block for block (same num_blocks and block size, its own kv heads): the
driver's block tables index both. Block copies (a beam or sample fork's partial block,
`KVCache.copy_block`) are recorded on the driver's pool and replayed before the next step.
Under pipeline parallelism the Step is the same: each rank runs its stage of it and the
stages pass hidden states and logits point to point (core.runtime.pipeline).

`check_mirror` is the invariant check for tests: every rank's pools have the driver's shape
and the rank's kv heads, and every rank has run the same number of steps.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.lora.ranks import LoraReceiver, LoraSender, LoraStep
from bestiary.core.runtime.kv_cache import KVCache
from bestiary.core.runtime.pipeline import micro_batch_count
from bestiary.core.runtime.worker_group import (
    WorkerGroup,
    join_world,
    live_engines,
    rank_device,
    torchrun_env,
    worker_group,
)

if TYPE_CHECKING:
    from bestiary.core.runtime.engine import Engine

# AttentionMetadata fields a Step carries: all but LoRA and the per-step caches (_*), which stay on the driver.
META_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionMetadata) if f.name != "lora" and not f.name.startswith("_"))
MAX_POOLS = 4  # KV pools a rank keeps per engine (the driver's executor and a test's runner, ...)


@dataclass
class Load:
    """Load `engine_dir` as engine `key` on every rank."""

    key: int
    engine_dir: str
    allow_nonfinite: bool


@dataclass
class Release:
    """Drop engine `key` and its KV pools."""

    key: int


@dataclass
class Step:
    """One forward of engine `key` on KV pool `pool` ((num_blocks, block_size) to allocate it)."""

    key: int
    pool: int
    pool_shape: tuple[int, int]
    ids: torch.Tensor  # [T] int64, CPU
    meta: dict[str, Any]  # META_FIELDS, tensors on the CPU
    all_logits: bool
    copies: list[tuple[int, int]]  # (dst, src) KV block copies before this step
    lora: LoraStep | None = None  # the step's adapters (core.lora.ranks)
    kernels: str = "auto"  # the driver's dispatch mode (kernels_mode("torch") there: eager decode on every rank)


@dataclass
class Probe:
    """Ask every rank for its step count and pool shapes (check_mirror)."""

    key: int


Message = Load | Release | Step | Probe | None  # None: the ranks exit


@dataclass
class Driven:
    """What the driver counts of an engine it drives (check_mirror compares every rank with it)."""

    key: int  # the engine's key on the ranks
    steps: int = 0  # Steps sent
    pools: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(KVCache) -> (num_blocks, block size)


# --- the driver --------------------------------------------------------------------------
def send(group: WorkerGroup, message: Message) -> None:
    """Broadcast one control message from rank 0."""
    dist.broadcast_object_list([message], src=0, group=group.control)


def receive(control: dist.ProcessGroup) -> Message:
    """The next control message (on a rank other than 0)."""
    box: list[Message] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def load_ranked(directory: str | Path, ranks: int, device: str = "cpu", registry=None, allow_nonfinite: bool = False,
                num_threads: int | None = None):
    """A `ranks`-rank engine (core.runtime.engine.load_engine): rank 0's Engine here, the other ranks
    spawned (or torchrun's). Under torchrun a rank other than 0 serves the driver's steps here and exits
    when it is done (SystemExit)."""
    if registry is not None and registry is not _default_registry():
        raise BestiaryError(f"{directory}: a {ranks}-rank engine loads its architecture from the installed plugins "
                            f"on every rank; install the plugin instead of passing a registry")
    env = torchrun_env()
    if env is not None and env[0] != 0:
        rank, size, local_rank = env
        try:
            serve(rank, rank_device(device, local_rank), join_world(rank, size, rank_device(device, local_rank)))
            dist.destroy_process_group()  # before the interpreter exits: gloo's threads end cleanly
        except Exception as err:  # noqa: BLE001 - one line; torchrun stops the other ranks
            report_and_exit(rank, err)
        raise SystemExit(0)
    group = worker_group(ranks, device, num_threads)
    return load_on_ranks(group, directory, allow_nonfinite)


def _default_registry():
    from bestiary.registry import default_registry

    return default_registry()


def load_on_ranks(group: WorkerGroup, directory: str | Path, allow_nonfinite: bool = False):
    """Every rank loads its rank file of `directory`; rank 0's Engine, its model driving the ranks."""
    from bestiary.core.runtime.engine import Engine

    for gone in loaded_engines(group) - live_engines(group):  # dropped without close(): free their ranks' copies
        loaded_engines(group).discard(gone)
        send(group, Release(gone))
    key = _next_key(group)
    send(group, Load(key, str(directory), allow_nonfinite))
    error, unexpected = None, None
    try:
        engine = Engine.load(directory, rank=0, device=group.device, allow_nonfinite=allow_nonfinite)
    except BestiaryError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - re-raised below, once the ranks are answered
        error, unexpected = f"{type(err).__name__}: {err}", err
    errors: list[str | None] = [None] * group.world_size
    dist.all_gather_object(errors, error, group=group.control)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        group.engine_keys.discard(key)
        send(group, Release(key))
        if unexpected is not None:
            raise unexpected
        rank, message = failed[0]
        raise BestiaryError(message if rank == 0 else f"rank {rank}: {message}")
    drive(engine.model, group, key)
    engine.group = group
    group.engine_refs[key] = weakref.ref(engine)
    return engine


def _next_key(group: WorkerGroup) -> int:
    key = max(group.engine_keys, default=0) + 1
    group.engine_keys.add(key)
    return key


def loaded_engines(group: WorkerGroup) -> set[int]:
    """Keys of the engines the group's ranks hold."""
    return group.engine_keys


def release(engine: Engine) -> None:
    """The ranks drop `engine` (rank 0's Engine of load_on_ranks); the group stays for the next one."""
    group, driven = engine.group, engine.model.__dict__.get("driven")
    if group is None or driven is None or group.closing or driven.key not in loaded_engines(group):
        return
    loaded_engines(group).discard(driven.key)
    send(group, Release(driven.key))


def drive(model: torch.nn.Module, group: WorkerGroup, key: int) -> None:
    """Make `model`'s forward broadcast each step before running it (an instance attribute, so
    type(model) and its methods stay the architecture's); its counts go to model.__dict__["driven"]."""
    driven = model.__dict__["driven"] = Driven(key)
    model.forward = functools.partial(_driven_forward, model.forward, group, driven)


def _driven_forward(forward, group: WorkerGroup, driven: Driven, ids: torch.Tensor, meta: AttentionMetadata,
                    kv_cache: KVCache, all_logits: bool = False) -> torch.Tensor:
    copies, kv_cache.pending_copies = list(getattr(kv_cache, "pending_copies", None) or []), []
    model = forward.__self__
    if model.pp_size > 1:  # every stage must cut the step the same way: the driver decides
        meta.micro_batches = micro_batch_count(meta.seq_lens, model.pp_size)
    fields = {name: getattr(meta, name) for name in META_FIELDS}
    fields = {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in fields.items()}
    shape = (kv_cache.num_blocks, kv_cache.tokens_per_block)
    lora = None if meta.lora is None else model.__dict__.setdefault("lora_sender", LoraSender()).message(meta.lora)
    step = Step(driven.key, id(kv_cache), shape, ids.cpu(), fields, all_logits, copies, lora, dispatch.mode())
    driven.steps += 1
    driven.pools[id(kv_cache)] = shape
    try:
        group.step_begins()
        send(group, step)
        group.step_sent()
        out = forward(ids, meta, kv_cache, all_logits=all_logits)
        group.step_ends()
        return out
    except RuntimeError as err:  # a peer died (its socket closed) or hung past the step timeout
        group.collective_failed(err)
        raise


def check_mirror(engine: Engine) -> list[dict[str, Any]]:
    """The multi-rank invariant (tests call it after a workload): every rank ran as many steps of
    `engine` as the driver sent, holds a pool for each of the driver's with the same blocks and
    block size, and its pools hold the kv heads `kv_heads_of_rank` gives its tp rank and the layers
    of its pipeline stage. Returns the reports (with each rank's PipelineStats under pp > 1)."""
    from bestiary.core.layers.self_attention import kv_heads_of_rank
    from bestiary.core.runtime.model import pp_layer_range

    group, model = engine.group, engine.model
    driven: Driven | None = model.__dict__.get("driven")
    assert group is not None and driven is not None, "check_mirror checks a multi-rank engine (load_on_ranks)"
    send(group, Probe(driven.key))
    mine = {"rank": 0, "steps": driven.steps, "pools": dict(driven.pools),
            "plan_steps": model.__dict__.get("plan_steps", 0), "pipeline": _pipeline_stats(model)}
    reports = _gather(group, mine)
    c = model.config
    kv_heads_total = c.num_key_value_heads
    assert kv_heads_total is not None, "PretrainedConfig's validator fills num_key_value_heads in"
    for report in reports[1:]:
        assert report["steps"] == mine["steps"], f"rank {report['rank']} ran {report['steps']} steps, driver {mine['steps']}"
        m = c.mapping
        heads = len(kv_heads_of_rank(c.num_attention_heads, kv_heads_total, m.tp_size, m.tp_rank(report["rank"])))
        layers = len(pp_layer_range(c.num_hidden_layers, m.pp_size, m.pp_rank(report["rank"])))
        for pool, (blocks, block_size, pool_layers, kv_heads, _) in report["pools"].items():
            assert (blocks, block_size) == mine["pools"].get(pool), f"rank {report['rank']} pool {pool} differs"
            assert kv_heads == heads, f"rank {report['rank']} holds {kv_heads} kv heads, expected {heads}"
            assert pool_layers == layers, f"rank {report['rank']} holds {pool_layers} layers, expected {layers}"
    return reports


def _gather(group: WorkerGroup, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's answer to a Probe, in rank order (`mine`: rank 0's)."""
    gathered: list[dict[str, Any] | None] = [None] * group.world_size
    dist.all_gather_object(gathered, mine, group=group.control)
    reports = [r for r in gathered if r is not None]
    assert len(reports) == len(gathered), "every rank answers a Probe with its report"
    return reports


def _pipeline_stats(model) -> dict | None:
    """A rank's PipelineStats as JSON (None before its first pipeline step, or at pp 1)."""
    stats = model.__dict__.get("pipeline_stats")
    return None if stats is None else stats.to_json()


# --- the other ranks -----------------------------------------------------------------------
def serve(rank: int, device: str, control) -> None:
    """Rank `rank`'s loop: run the driver's messages until a None one."""
    from bestiary.core.runtime.engine import Engine

    engines: dict[int, Engine] = {}
    pools: dict[int, dict[int, KVCache]] = {}
    steps: dict[int, int] = {}
    while True:
        message = receive(control)
        if message is None:
            return
        if isinstance(message, Load):
            error = None
            try:
                engines[message.key] = Engine.load(message.engine_dir, rank=rank, device=device,
                                                   allow_nonfinite=message.allow_nonfinite)
                pools[message.key], steps[message.key] = {}, 0
            except BestiaryError as err:
                error = str(err)
            except Exception as err:  # noqa: BLE001 - sent to the driver, which raises it
                error = f"{type(err).__name__}: {err}"
            dist.all_gather_object([None] * dist.get_world_size(), error, group=control)
        elif isinstance(message, Release):
            engines.pop(message.key, None)
            pools.pop(message.key, None)
        elif isinstance(message, Probe):
            model_pools = pools.get(message.key, {})
            engine = engines.get(message.key)
            report = {"rank": rank, "steps": steps.get(message.key),
                      "plan_steps": 0 if engine is None else engine.model.__dict__.get("plan_steps", 0),
                      "pipeline": None if engine is None else _pipeline_stats(engine.model),
                      "pools": {p: (kv.num_blocks, kv.tokens_per_block, kv.k.shape[0], *kv.k.shape[3:])
                                for p, kv in model_pools.items()}}
            dist.all_gather_object([None] * dist.get_world_size(), report, group=control)
        else:
            run_step(engines[message.key], pools[message.key], message, device)
            steps[message.key] += 1


@torch.inference_mode()
def run_step(engine, pools: dict[int, KVCache], step: Step, device: str) -> None:
    """One driver step on this rank's shard: its pool (made on first use), the block copies, the forward."""
    kv = pools.get(step.pool)
    if kv is None or (kv.num_blocks, kv.tokens_per_block) != step.pool_shape:
        if len(pools) >= MAX_POOLS:
            pools.pop(next(iter(pools)))
        kv = pools[step.pool] = KVCache.for_model(engine.model, *step.pool_shape)
    for dst, src in step.copies:
        kv.copy_block(dst, src)
    fields: dict[str, Any] = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in step.meta.items()}
    meta = AttentionMetadata(**fields)
    if step.lora is not None:  # this rank's shard of the step's adapters
        meta.lora = engine.__dict__.setdefault("lora_receiver", LoraReceiver(engine.model)).step(step.lora, device)
    with dispatch.kernels_mode(step.kernels):
        engine.model(step.ids.to(device), meta, kv, all_logits=step.all_logits)


def report_and_exit(rank: int, err: BaseException) -> None:
    """A torchrun rank's failure: one line naming the rank, exit status 1 (torchrun stops the others)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    sys.stderr.write(f"bestiary: rank {rank} (pid {os.getpid()}) failed: {first}\n")
    sys.stderr.flush()
    os._exit(1)

