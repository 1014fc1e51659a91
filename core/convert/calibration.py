"""Running the float model over calibration tokens at convert.

Calibration tokens (`calibration_ids`): `--calib_text FILE` through the source's tokenizer, else a
built-in text (core.quant.calib_text), else (no tokenizer) seeded random token ids.

The runs: each chunk of at most `chunk` tokens is one sequence from position 0 through a private
float KV cache (`run_sequence`, `chunk_logits`, `run_chunks`). `collect_linear_inputs` records every
Linear's input statistics (core.quant.input_stats) with forward pre-hooks, keyed by the Linear's
canonical `name`; every token also goes through lm_head (all_logits). The model must be unfused
(no `prepare_for_inference`), so fused fc/gate matmuls still go through their `Linear`s.
Users: weight quantizers (core.convert.quantize_calibrated), scale tuning (core.convert.tune), KV
cache scales (core.convert.kv_scales), the converted checkpoint's lint (core.convert.lint).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from bestiary.core.format.config import read_text_file
from bestiary.core.format.errors import BestiaryError
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.calib_text import builtin_text
from bestiary.core.quant.input_stats import LinearInputStats, _Accumulator
from bestiary.core.runtime.kv_cache import KVCache, blocks_for
from bestiary.core.runtime.model import DecoderLM, sequence_metadata

DEFAULT_CHUNK = 512
HEAD = "lm_head"  # the canonical name of the output projection's Linear
CALIB_TOKENS = 512  # KV scale calibration's tokens at most
BUILTIN_TEXT = builtin_text("kv_calibration.txt")  # a short general text (package data)


def calibration_ids(files, vocab_size: int, text_file: str | Path | None, max_positions: int | None,
                    limit: int | None = None, builtin: str = BUILTIN_TEXT) -> list[int]:
    """The calibration token ids (see the module docstring); `files`: the source's TokenizerFiles or None.

    `limit`: at most this many tokens instead (callers that run them in chunks, e.g.
    core.convert.quantize_calibrated), with `builtin` as the text when no file is given."""
    from bestiary.core.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(files.tokenizer_json, files.tokenizer_config) if files is not None else None
    if limit is None:
        limit = min(CALIB_TOKENS, max_positions or CALIB_TOKENS)
    if text_file is not None:
        path = Path(text_file)
        if not path.is_file():
            raise BestiaryError(f"--calib_text {path}: no such file")
        if tokenizer is None:
            raise BestiaryError(f"--calib_text {path}: the source has no tokenizer to read it with")
        ids = tokenizer.encode(read_text_file(path, "--calib_text"))
        if len(ids) < 16:
            raise BestiaryError(f"--calib_text {path}: {len(ids)} tokens, expected at least 16")
        return _in_vocab(ids[:limit], vocab_size, tokenizer.source)
    if tokenizer is not None:
        return _in_vocab(tokenizer.encode(builtin)[:limit], vocab_size, tokenizer.source)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (limit,), generator=gen).tolist()


def _in_vocab(ids: list[int], vocab_size: int, source: str) -> list[int]:
    """`ids`, each a row of the embedding ([0, vocab_size)); else one line naming the tokenizer and the id."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise BestiaryError(f"{source}: token id {bad} is outside the model's vocabulary [0, {vocab_size}) "
                            "(config.json: vocab_size); use the model's own tokenizer")
    return ids


def run_sequence(model: DecoderLM, ids: list[int], all_logits: bool, block_size: int = 32):
    """Run `ids` as one sequence from position 0 through a private, zeroed float KV cache; returns
    (logits [len(ids), V] with `all_logits`, else [1, V]; the KVCache holding the sequence's K and V)."""
    blocks = list(range(blocks_for(len(ids), block_size)))
    kv = KVCache.for_model(model, len(blocks), block_size)
    kv.k.zero_()
    kv.v.zero_()
    meta = sequence_metadata(model, ids, 0, len(ids), blocks, block_size)
    return model(torch.tensor(ids), meta, kv, all_logits=all_logits), kv


def chunk_logits(model: DecoderLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of `ids` as one sequence from position 0, through a private float KV cache."""
    return run_sequence(model, ids, all_logits=True)[0]


def calibration_chunks(model: DecoderLM, ids: list[int], chunk: int = DEFAULT_CHUNK) -> list[list[int]]:
    """`ids` cut into sequences of at most `chunk` tokens (and the model's max_position_embeddings)."""
    limit = getattr(model.config, "max_position_embeddings", None) or chunk
    chunk = max(1, min(chunk, limit))
    return [ids[start:start + chunk] for start in range(0, len(ids), chunk)]


def run_chunks(model: DecoderLM, ids: list[int], chunk: int = DEFAULT_CHUNK,
               on_chunk: Callable[[], None] | None = None,
               on_logits: Callable[[torch.Tensor], None] | None = None) -> None:
    """Run `model` (float KV cache) over `ids` in sequences of at most `chunk` tokens (all logits);
    `on_logits(logits [T, V])` sees each sequence's logits."""
    for part in calibration_chunks(model, ids, chunk):
        logits = chunk_logits(model, part)
        if on_logits is not None:
            on_logits(logits)
        if on_chunk is not None:
            on_chunk()


@torch.inference_mode()
def collect_linear_inputs(
    model: DecoderLM,
    ids: list[int],
    hessian: bool,
    names: set[str] | None = None,
    chunk: int = DEFAULT_CHUNK,
    on_chunk: Callable[[], None] | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, LinearInputStats]:
    """linear.name -> LinearInputStats of every Linear of `model` (or those in `names`) over `ids`; a model
    that shares its embedding has no lm_head Linear, and its head's input (DecoderLM.tied_head) is recorded as
    HEAD's, the input an untied lm_head Linear would see.

    `hessian`: also accumulate sum_t x_t x_t^T (float32 [K, K] per layer); `on_logits`: sees each
    calibration sequence's logits [T, V] (the float model's, e.g. as a distillation target)."""
    accs: dict[str, _Accumulator] = {}
    handles = []
    for path, module in model.named_modules():
        name = (module.name or path) if isinstance(module, Linear) else None
        if name is None or (names is not None and name not in names):
            continue
        acc = accs[name] = _Accumulator(hessian)
        handles.append(module.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add(args[0])))
    if model.shares_embedding and (names is None or HEAD in names):
        handles.append(_TiedHeadHook(model, accs.setdefault(HEAD, _Accumulator(hessian))))
    try:
        run_chunks(model, ids, chunk, on_chunk, on_logits)
    finally:
        for h in handles:
            h.remove()
    return {name: acc.stats() for name, acc in accs.items() if acc.tokens}


class _TiedHeadHook:
    """A forward pre-hook on `model.tied_head`, which is a method, not a module: an instance attribute over it
    adds each input hidden [T, E] to `acc` before the head runs, until `remove()` (as a hook handle's)."""

    def __init__(self, model: DecoderLM, acc: _Accumulator) -> None:
        head = model.tied_head

        def observed(hidden: torch.Tensor) -> torch.Tensor:
            acc.add(hidden)
            return head(hidden)

        self.model = model
        setattr(model, "tied_head", observed)  # noqa: B010 (a method is shadowed, which mypy refuses as an assignment)

    def remove(self) -> None:
        del self.model.__dict__["tied_head"]


# --- one calibration run shared by several converts (opt-in) -----------------------------------

_shared: dict[str, tuple[dict[str, LinearInputStats], list]] | None = None  # key -> (stats, targets)


@contextmanager
def shared_calibration() -> Iterator[None]:
    """Inside this block, calibrated converts of the same float weights, config and tokens run the
    float model over the calibration tokens once: the first computes the statistics of every
    Linear with Hessians, and the teacher targets (core.convert.tune), and the others take copies.
    What a convert reads of them is what it would have computed alone (hooks only observe; a mode
    needing no Hessian ignores it). For callers that convert one source in several modes (the
    quantization quality tests); memory: one run's statistics, kept until the block ends."""
    global _shared
    outer, _shared = _shared, {} if _shared is None else _shared
    try:
        yield
    finally:
        _shared = outer


def shared_calibration_active() -> bool:
    """True inside shared_calibration()."""
    return _shared is not None


def fingerprint(tensors: dict[str, torch.Tensor], config_json: str, ids: list[int]) -> str:
    """A digest of the float weights (names, shapes, dtypes, bytes), the config and the tokens."""
    h = hashlib.blake2b(digest_size=20)
    h.update(config_json.encode())
    h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _without_alias_copies(weights: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """`weights` less every alias (DecoderLM.source_aliases: an untied copy of a tied lm_head) that holds its
    source's values exactly: that model computes what the model sharing the tensor does (and its lm_head's input
    is recorded under the same name, collect_linear_inputs), so the two key one shared run."""
    def copy_of_source(alias: str) -> bool:
        t, src = weights.get(alias), weights.get(aliases[alias])
        return (t is not None and src is not None and t.dtype == src.dtype and t.shape == src.shape
                and bool(torch.equal(t, src)))

    copies = {alias for alias in aliases if copy_of_source(alias)}
    return {k: v for k, v in weights.items() if k not in copies}


def calibrate_linears(model: DecoderLM, ids: list[int], hessian: bool, names: set[str], targets: bool,
                      weights: dict[str, torch.Tensor], config_json: str,
                      on_chunk: Callable[[], None] | None = None) -> tuple[dict[str, LinearInputStats], list]:
    """(linear name -> LinearInputStats for `names`, the float model's TeacherTargets per calibration
    sequence when `targets`, else []) from one run of `model` over `ids` (collect_linear_inputs).
    Inside shared_calibration() the run is the one shared by every convert of the same `weights` (the
    float tensors the model holds, less an untied copy of a tied lm_head: _without_alias_copies), `config_json`
    and `ids`: it records every Linear with Hessians, and
    the targets, so any mode can take its part."""
    from bestiary.core.convert.tune import TeacherTargets

    found: list = []

    def record(logits: torch.Tensor) -> None:
        found.append(TeacherTargets.from_logits(logits))

    shared = _shared  # inside shared_calibration(): key -> (stats, targets) of the runs so far
    if shared is None:
        stats = collect_linear_inputs(model, ids, hessian=hessian, names=names, on_chunk=on_chunk,
                                      on_logits=record if targets else None)
        return stats, found
    key = fingerprint(_without_alias_copies(weights, model.source_aliases()), config_json, ids)
    if key in shared:
        if on_chunk is not None:  # the progress bar still counts the chunks
            for _ in calibration_chunks(model, ids):
                on_chunk()
    else:  # every Linear, with Hessians, and the targets: any mode takes its part
        shared[key] = (collect_linear_inputs(model, ids, hessian=True, names=None, on_chunk=on_chunk,
                                             on_logits=record), found)
    stats, found = shared[key]
    mine = {n: _copy(s, hessian) for n, s in stats.items() if n in names}
    return mine, [replace(t) for t in found] if targets else []


def _copy(s: LinearInputStats, hessian: bool) -> LinearInputStats:
    """A private copy (a convert's AWQ folds replace statistics; GPTQ reads the Hessian)."""
    h = s.hessian.clone() if hessian and s.hessian is not None else None
    return LinearInputStats(s.absmax.clone(), s.amax, h, s.tokens)
