"""Loading an engine dir (or a checkpoint dir) into a ready model + tokenizer on one rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bestiary.core.format.build_config import FORMAT_VERSION, BuildConfig, finalize_build_config
from bestiary.core.format.checkpoint import load_rank_weights, rank_file
from bestiary.core.format.config import (
    PretrainedConfig,
    config_mapping,
    config_sections,
    read_json,
    validate_config,
)
from bestiary.core.format.errors import BestiaryError, ConfigError
from bestiary.core.kernels.cpu.malloc import keep_freed_memory, release_freed_memory
from bestiary.core.layers import cpu_matmul
from bestiary.core.runtime.model import DecoderLM
from bestiary.core.runtime.pipeline import stage_tp_group
from bestiary.core.runtime.rank_weights import assign, check_rank_tensors, load_by_layer
from bestiary.core.runtime.tokenizer import Tokenizer
from bestiary.registry import Registry, default_registry, resolve

if TYPE_CHECKING:
    from bestiary.core.runtime.worker_group import WorkerGroup


def validate_model_config(data: dict, source: str, registry: Registry | None = None,
                          prefix: str = "") -> PretrainedConfig:
    """A checkpoint config.json dict as its architecture's config class (errors name field and file;
    `prefix`: where the dict sits in the file, 'pretrained_config.' in an engine's)."""
    if not isinstance(data, dict):  # an engine's pretrained_config that is not an object
        where = f"field '{prefix.rstrip('.')}'" if prefix else "the model config (pretrained_config)"
        raise ConfigError(f"{source}: {where}: expected a JSON object, got {type(data).__name__} ({data!r:.60})")
    arch = data.get("architecture")
    if not arch:
        raise ConfigError(f"{source}: field '{prefix}architecture' is missing")
    if not isinstance(arch, str):
        raise ConfigError(f"{source}: field '{prefix}architecture': expected the name of a registered architecture, "
                          f"got {type(arch).__name__} {arch!r:.60}")
    spec = (registry or default_registry()).get(arch)
    return validate_config(resolve(spec.config_class), data, source, prefix)


def check_world(directory: Path, config: PretrainedConfig) -> None:
    """A multi-rank engine loads inside a torch.distributed world of its size (LLM, `bestiary run`
    and engine.load_engine start one)."""
    m = config.mapping
    if m.world_size == 1:
        return
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world != m.world_size:
        raise BestiaryError(
            f"{directory}: has {m.world_size} ranks (tp {m.tp_size}, pp {m.pp_size}); load it with LLM(...) or `bestiary run`, "
            f"which start its ranks (this process is in a world of {world})"
        )


@dataclass
class Engine:
    """A loaded model for one rank, its limits and its tokenizer."""

    directory: Path
    config: PretrainedConfig
    build: BuildConfig
    model: DecoderLM
    tokenizer: Tokenizer | None
    group: WorkerGroup | None = None  # the WorkerGroup driving the other ranks (core.runtime.step_broadcast)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output: the build's max_seq_len, which `load` finalizes (never None here)."""
        assert self.build.max_seq_len is not None, "Engine.load finalizes the build config"
        return self.build.max_seq_len

    @classmethod
    def load(
        cls, directory: str | Path, rank: int = 0, device: str = "cpu", registry: Registry | None = None,
        allow_nonfinite: bool = False,
    ) -> Engine:
        """Read config.json, build the model on the meta device and assign the rank's tensors
        (NaN or inf weights are refused unless `allow_nonfinite`)."""
        registry = registry or default_registry()
        directory = Path(directory)
        if not directory.is_dir():
            raise BestiaryError(f"{directory}: no such engine directory")
        if device == "cpu":
            keep_freed_memory()  # prefill's large activations reuse freed heap (core.kernels.cpu.malloc)
        source = str(directory / "config.json")
        data = read_json(directory / "config.json")
        model_data, build_data = config_sections(data, source)
        if build_data is not None:
            version = data.get("format_version")
            if version != FORMAT_VERSION:
                raise ConfigError(f"{source}: format_version {version!r}, expected {FORMAT_VERSION}")
            build = validate_config(BuildConfig, build_data, source, "build_config.")
        else:  # a checkpoint dir runs with default limits
            build = BuildConfig()
        prefix = "pretrained_config." if build_data is not None else ""
        config = validate_model_config(model_data, source, registry, prefix)
        build = finalize_build_config(build, model_data, str(directory / "config.json"), "pretrained_config" in data)
        check_world(directory, config)
        spec = registry.get(config.architecture)
        m = config.mapping
        tp_group = stage_tp_group(m.tp_size, m.pp_size, rank) if m.world_size > 1 else None  # collective: every rank
        try:
            with torch.device("meta"):
                model = resolve(spec.model_class)(config, rank, device="meta")
        except (TypeError, ValueError) as err:  # a field the model needs is missing or inconsistent
            raise ConfigError(f"{directory / 'config.json'}: the model cannot be built from this config ({err})") from None
        tokenizer = Tokenizer.from_dir(directory)
        if tokenizer is not None:
            tokenizer.check_vocab(config.vocab_size, source)
        if tp_group is not None:
            model.use_tp_group(tp_group)
        path = rank_file(directory, rank)
        with cpu_matmul.repack_in_place():  # the tensors are this load's own reads from `path`
            if device == "cpu":  # a layer at a time: the load holds the prepared model and about one layer
                load_by_layer(model, path, allow_nonfinite)
            else:
                weights = load_rank_weights(directory, rank, allow_nonfinite)
                check_rank_tensors(model.state_dict(), {k: t.dtype for k, t in weights.items()}, str(path))
                assign(model, weights, str(path))
                del weights
            model.to(device)
            model.eval()
            model.prepare_for_inference()
        if device == "cpu":
            release_freed_memory()  # the load's freed sources (core.kernels.cpu.malloc)
        return cls(directory, config, build, model, tokenizer)


def engine_ranks(directory: str | Path) -> tuple[int, int]:
    """(tp_size, pp_size) of an engine or checkpoint dir (1, 1 when config.json says nothing)."""
    path = Path(directory) / "config.json"
    mapping = config_mapping(read_json(path), str(path))
    return mapping.tp_size, mapping.pp_size


def load_engine(directory: str | Path, device: str = "cpu", registry: Registry | None = None,
                allow_nonfinite: bool = False, num_threads: int | None = None) -> Engine:
    """The Engine of `directory` for this process, the entry point of LLM and the CLI: loaded here alone
    (one rank), or as rank 0 of its worker group (tp_size * pp_size > 1: core.runtime.step_broadcast)."""
    tp, pp = engine_ranks(directory)
    if tp * pp == 1:
        return Engine.load(directory, device=device, registry=registry, allow_nonfinite=allow_nonfinite)
    from bestiary.core.runtime.step_broadcast import load_ranked

    return load_ranked(directory, tp * pp, device, registry, allow_nonfinite, num_threads)
