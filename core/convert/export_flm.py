"""`bestiary export --format flm`: a checkpoint or engine dir -> one FastLLM `.flm` file.

1. Read the dir's config.json (a checkpoint's, or an engine's pretrained_config) and its tokenizer;
   only single-rank models are exported (FastLLM files hold whole tensors).
2. Model info: the HF config of the architecture (`hf_config_of`, tables in
   core.convert.flm_tables), the chat template, and bestiary's tokenizer.json / tokenizer_config
   under `bestiary.*` keys (FastLLM ignores them; `bestiary convert` reads them back exactly).
   Vocab: every token with a score (BPE: -merge rank for merged tokens, 1 else; unigram: its score).
3. Tensors, one at a time from rank0.safetensors (core.format.safetensors_stream: plain reads, the whole
   header validated when the file is opened; resident memory: the current layer's tensors),
   under HF names: the architecture's key map translates each canonical key, and the inverse of
   its postprocess hook (`flm_tables.INVERSE_HOOKS`) splits fused rows (qkv -> q, k, v;
   [Q; K; V] -> per-head order; gate + up -> dense_h_to_4h).
4. Each Linear weight in `--flm_dtype` (default: the layout it has): codes are copied exactly
   when the layout allows (W8A16 -> int8; W4A16 with integer zero points -> int4 grouped; per-row
   int4 when every group of a row shares (s, z)), otherwise the dequantized weight is quantized
   with FastLLM's own rule and the error it adds is printed. Other tensors: float32 (float16
   when --flm_dtype float16), as FastLLM's exporter writes them.
5. The file is written inside a marked temporary directory beside `output_file` and renamed over it
   at the end (core.format.staging), so an error or Ctrl-C leaves no partial file. Its info table
   carries `bestiary.export`: a tag and a digest of the file (its size, info table and the rest,
   sampled beyond 64 MiB), patched in last. Only a file whose mark still matches is replaced by a later export:
   a FastLLM-made .flm, a file another tool re-saved, or anything else never is.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from bestiary.core.convert import flm_encode
from bestiary.core.convert.flm_tables import INVERSE_HOOKS, hf_config_of
from bestiary.core.convert.progress import progress
from bestiary.core.format.checkpoint import SAFETENSORS_DTYPES
from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError, ConfigError, WeightsError
from bestiary.core.format.output_dir import check_output_file
from bestiary.core.format.safetensors_stream import SafetensorsStream, TensorEntry
from bestiary.core.format.staging import staged_file
from bestiary.core.sources.flm_format import VERSION, pack_int, pack_string, pack_token

FLM_DTYPES = ("float32", "float16", "int8", "int4", "int4g128")
EXPORTABLE_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ")  # weight-only: FastLLM's int8 / int4


# ---- reading the model dir -----------------------------------------------------------------------


def read_model_dir(directory: Path):
    """(config, spec, tokenizer json text or None, tokenizer_config) of a checkpoint or engine dir."""
    from bestiary.core.runtime.engine import validate_model_config
    from bestiary.core.runtime.tokenizer import Tokenizer
    from bestiary.registry import default_registry

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise BestiaryError(f"{directory}: no config.json (expected a checkpoint or engine directory)")
    data = read_json(directory / "config.json")
    model_data = data.get("pretrained_config", data)
    config = validate_model_config(model_data, str(directory / "config.json"))
    if config.mapping.world_size != 1:
        raise BestiaryError(f"{directory}: a {config.mapping.world_size}-rank model; FastLLM files hold whole "
                            f"tensors: convert with --tp_size 1 --pp_size 1 to export")
    algo = getattr(config.quantization.quant_algo, "value", config.quantization.quant_algo)  # a str either way
    if algo is not None and algo not in EXPORTABLE_ALGOS:
        raise BestiaryError(f"{directory}: quant_algo {algo} (activation-quantized); FastLLM files hold "
                            f"float, W8A16 or W4A16 linears: export the model converted without it")
    spec = default_registry().get(config.architecture)
    tokenizer = Tokenizer.from_dir(directory)  # tokenizer.json and its config validated as a run validates them
    if tokenizer is not None:
        tokenizer.check_vocab(config.vocab_size, str(directory / "config.json"))
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.is_file() else {}
    tokenizer_json = (directory / "tokenizer.json").read_text("utf-8") if tokenizer is not None else None
    return config, spec, tokenizer_json, tok_config


# ---- header and vocab ----------------------------------------------------------------------------


def _model_kind(tokenizer_json: str) -> str:
    """The model kind tokenizers reads a tokenizer.json without `model.type` as ("BPE", "WordLevel", ...)."""
    from tokenizers import Tokenizer as HFTokenizer

    return type(HFTokenizer.from_str(tokenizer_json).model).__name__


def vocab_entries(tokenizer_json: str) -> tuple[list[tuple[bytes, int, float]], dict[str, str]]:
    """(entries, tokenizer info flags) of a tokenizer.json, scored the way FastLLM's exporter scores."""
    data = json.loads(tokenizer_json)  # validated by tokenizers in read_model_dir: the fields of its model kind
    model = data["model"]
    kind = model.get("type") or _model_kind(tokenizer_json)
    flags: dict[str, str] = {"tokenizer_use_score": "1"}
    if kind == "Unigram":
        entries = [(piece.encode(), i, float(score)) for i, (piece, score) in enumerate(model["vocab"])]
    else:
        merged: dict[str, float] = {}
        for rank, merge in enumerate(model.get("merges", []) if kind == "BPE" else []):  # others ignore "merges"
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            merged.setdefault(a + b, -float(rank))
        entries = [(piece.encode(), token_id, merged.get(piece, 1.0)) for piece, token_id in model["vocab"].items()]
    known = {e[1] for e in entries}
    entries += [(t["content"].encode(), t["id"], 1.0) for t in data.get("added_tokens", []) if t["id"] not in known]
    decoder = json.dumps(data.get("decoder") or {})
    flags["tokenizer_byte_as_char"] = str('"ByteLevel"' in decoder)
    flags["tokenizer_add_dummy_prefix"] = str('"Metaspace"' in json.dumps(data.get("pre_tokenizer") or {}))
    return sorted(entries, key=lambda e: e[1]), flags


def model_info(config, tokenizer_json: str | None, tok_config: dict) -> dict[str, str]:
    """The key/value table: HF config, chat template, tokenizer flags, bestiary's tokenizer files."""
    info = {k: v if isinstance(v, str) else str(v) for k, v in hf_config_of(config).items()}
    if tokenizer_json is not None:
        ids = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}
        for key in ("bos", "eos", "pad"):
            token = tok_config.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token in ids and f"{key}_token_id" not in info:
                info[f"{key}_token_id"] = str(ids[token])
        if isinstance(tok_config.get("chat_template"), str):
            info["chat_template"] = tok_config["chat_template"]
        info["bestiary.tokenizer_json"] = tokenizer_json
        info["bestiary.tokenizer_config"] = json.dumps(tok_config)
    return info


def info_table(info: dict[str, str]) -> bytes:
    """Version, then the key/value table (keys sorted)."""
    out = [pack_int(VERSION, len(info))]
    for key in sorted(info):
        out += [pack_string(key), pack_string(info[key])]
    return b"".join(out)


def vocab_table(entries: list[tuple[bytes, int, float]]) -> bytes:
    """The vocab: its size, then each (piece, id, score)."""
    return b"".join([pack_int(len(entries)), *(pack_token(piece, i, score) for piece, i, score in entries)])


# ---- tensors -------------------------------------------------------------------------------------


Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # state-dict key -> (dtype, shape)


def _model_layout(spec, config) -> tuple[dict[str, object], Layout]:
    """(module path -> Linear, every tensor's dtype and shape) of the single-rank model (on the meta device)."""
    from bestiary.core.convert.source_to_checkpoint import instantiate
    from bestiary.core.layers.linear import Linear

    model = instantiate(spec, config, 0)
    layout = {key: (t.dtype, tuple(t.shape)) for key, t in model.state_dict().items()}
    return {path: m for path, m in model.named_modules() if isinstance(m, Linear)}, layout


def check_rank_layout(path: Path, entries: dict[str, TensorEntry], layout: Layout) -> None:
    """The rank file holds exactly the model's tensors, each of the model's dtype and shape (what Engine.load
    requires), so a well-formed file of the wrong tensors is one line before anything is written."""
    missing, unexpected = sorted(set(layout) - set(entries)), sorted(set(entries) - set(layout))
    if missing or unexpected:
        what = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {unexpected[0]!r}"
        raise WeightsError(f"{path}: {what} (the model of its config.json has {len(layout)} tensors)")
    for key, (dtype, shape) in layout.items():
        entry = entries[key]
        if (entry.dtype, entry.shape) != (dtype, shape):
            raise WeightsError(f"{path}: tensor {key!r} is {SAFETENSORS_DTYPES[entry.dtype]} {list(entry.shape)}; "
                               f"the model needs {SAFETENSORS_DTYPES.get(dtype, str(dtype))} {list(shape)}")


class _NoSource:
    """The loader is used only to translate names here: a WeightSource holding no tensor."""

    def keys(self) -> list[str]:
        return []

    def shape(self, key: str) -> tuple[int, ...]:
        raise KeyError(key)

    def file_of(self, key: str) -> str:
        raise KeyError(key)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        raise KeyError(key)


def hf_tensors(directory: Path, config, spec) -> Iterator[tuple[str, dict[str, torch.Tensor], bool]]:
    """(HF name, bundle, is_linear) in checkpoint order; a bundle is {"value"} or a quantized linear's
    {"weight", "weights_scaling_factor"[, "zeros"]}, rows split/merged back to the HF layout."""
    from bestiary.core.convert.loader import WeightsLoader

    loader = WeightsLoader(_NoSource(), spec, config)
    linears, layout = _model_layout(spec, config)
    pending: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    path = directory / "rank0.safetensors"
    if not path.is_file():
        raise BestiaryError(f"{directory}: no rank0.safetensors")
    with SafetensorsStream(path) as f:
        check_rank_layout(path, f.entries, layout)
        keys = list(f.keys())
        names = set(keys)
        for key in keys:
            module, _, leaf = key.rpartition(".")
            if leaf in ("weights_scaling_factor", "zeros", "in_perm"):
                continue  # read with their weight
            if leaf == "in_perm" or f"{module}.in_perm" in names:
                raise BestiaryError(f"{path}: {module} has act-order in_perm (GPTQ); FastLLM files cannot hold it")
            quantized = leaf == "weight" and f"{module}.weights_scaling_factor" in names
            bundle = {"weight" if quantized else "value": f.get_tensor(key)}
            if quantized:
                bundle["weights_scaling_factor"] = f.get_tensor(f"{module}.weights_scaling_factor")
                if f"{module}.zeros" in names:
                    bundle["zeros"] = f.get_tensor(f"{module}.zeros")
            sources = loader.translate(key, module)
            hook = next((ref for pattern, ref in spec.postprocess.items() if fnmatch.fnmatchcase(key, pattern)), None)
            inverse = INVERSE_HOOKS.get(hook or "identity")
            if inverse is None:
                raise BestiaryError(f"{config.architecture}: no inverse of postprocess hook {hook} for {key!r}; "
                                    f"this architecture cannot be exported to .flm")
            is_linear = leaf == "weight" and module in linears
            for source_key, part, index, total in inverse(key, bundle, sources, config):
                if total == 1:
                    yield source_key, part, is_linear
                    continue
                halves = pending.setdefault(source_key, {})
                halves[index] = part
                if len(halves) == total:
                    merged = {name: torch.cat([halves[i][name] for i in range(total)]) for name in part}
                    del pending[source_key]
                    yield source_key, merged, is_linear
    if pending:
        raise BestiaryError(f"{path}: {min(pending)!r} is missing some of its fused parts")


EXPORT_KEY = "bestiary.export"  # the mark of bestiary's exports: the only .flm files an export replaces
EXPORT_TAG = "bestiary-flm-export v1 "
DIGEST_HEX = 32
EXPORT_PLACEHOLDER = EXPORT_TAG + "0" * DIGEST_HEX  # patched with export_digest once the file is written
FULL_DIGEST_BYTES = 64 << 20  # files up to this size after the info table are hashed whole, larger ones sampled
DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES = 64, 64 << 10


def export_digest(path: Path, info_start: int, info_end: int, mark_at: int) -> str:
    """blake2b of the file's size, its info table (the mark itself as the placeholder) and the rest: whole
    up to FULL_DIGEST_BYTES, else 64 samples of 64 KiB from its start to its end (4 MiB read, whatever the
    size), so a file another tool rewrote or re-saved no longer matches its mark."""
    size = path.stat().st_size
    h = hashlib.blake2b(struct.pack("<3q", size, info_start, info_end), digest_size=DIGEST_HEX // 2)
    with open(path, "rb") as f:
        f.seek(info_start)
        info = bytearray(f.read(info_end - info_start))
        placeholder = EXPORT_PLACEHOLDER.encode()
        info[mark_at - info_start:mark_at - info_start + len(placeholder)] = placeholder
        h.update(info)
        rest = max(size - info_end, 0)
        if rest <= FULL_DIGEST_BYTES:
            while chunk := f.read(8 << 20):
                h.update(chunk)
            return h.hexdigest()
        for i in range(DIGEST_SAMPLES):
            f.seek(info_end + (rest - DIGEST_SAMPLE_BYTES) * i // (DIGEST_SAMPLES - 1))
            h.update(f.read(DIGEST_SAMPLE_BYTES))
    return h.hexdigest()


def read_mark(path: Path) -> tuple[str, int, int, int] | None:
    """(the EXPORT_KEY value, info start, info end, offset of the value) of a .flm file, or None when it
    is not a version-2 .flm or carries no mark. Reads the info table only, each length bounded by the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                return None
            version, count = struct.unpack("<2i", head)
            if version != VERSION or not 0 <= count <= size // 8:
                return None
            mark, is_key = None, False
            for i in range(2 * count):
                raw = f.read(4)
                n = struct.unpack("<i", raw)[0] if len(raw) == 4 else -1
                if not 0 <= n <= size - f.tell():
                    return None
                at, text = f.tell(), f.read(n)
                if i % 2 == 0:
                    is_key = text == EXPORT_KEY.encode()
                elif is_key:
                    mark = (text.decode("utf-8", "replace"), at)
            end = f.tell()
    except OSError:
        return None
    return None if mark is None else (mark[0], 8, end, mark[1])


def is_bestiary_export(path: Path) -> bool:
    """Whether `path` is a .flm file bestiary exported and nothing rewrote since (its mark's digest holds)."""
    mark = read_mark(Path(path))
    if mark is None or not mark[0].startswith(EXPORT_TAG) or len(mark[0]) != len(EXPORT_PLACEHOLDER):
        return False
    value, info_start, info_end, at = mark
    try:
        return value[len(EXPORT_TAG):] == export_digest(Path(path), info_start, info_end, at)
    except OSError:
        return False


def check_output(output: Path, model_dir: Path | None = None) -> Path:
    """`output` must end in .flm, and an existing file there must be an earlier bestiary export
    (`is_bestiary_export`): a FastLLM-made .flm or any other file is never replaced."""
    if Path(output).suffix != ".flm":
        raise BestiaryError(f"--output_file {output}: expected a file name ending in .flm")
    sources = [model_dir] if model_dir is not None else []
    return check_output_file(output, sources, "--output_file", replaceable=is_bestiary_export)


def write_mark(path: Path, header_at: int, info_end: int) -> None:
    """Patch EXPORT_KEY's placeholder in the finished file `path` with its digest."""
    with open(path, "rb") as f:
        head = f.read(info_end)
    pair = pack_string(EXPORT_KEY) + pack_string(EXPORT_PLACEHOLDER)
    at = head.find(pair, header_at) + len(pair) - len(EXPORT_PLACEHOLDER)
    digest = export_digest(path, header_at, info_end, at)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write((EXPORT_TAG + digest).encode())


ACT_QUANT_KEY = "bestiary.activation_quant"  # absent in FastLLM's files: they run as FastLLM computes


def default_dtype(config) -> str:
    """The .flm type that holds the model's linears as they are."""
    algo = config.quantization.quant_algo
    if algo == "W8A16":
        return "int8"
    if algo in ("W4A16", "W4A16_AWQ"):
        return "int4g128" if config.quantization.group_size == 128 else f"int4g{config.quantization.group_size}"
    return "float16" if config.dtype in ("float16", "bfloat16") else "float32"


def export_flm(model_dir: str | Path, output_file: str | Path, flm_dtype: str | None = None,
               show_progress: bool = True) -> Path:
    """Write `model_dir` (checkpoint or engine dir) as the FastLLM file `output_file`; returns its path.

    An existing `output_file` is replaced only when it is an earlier bestiary export (`check_output`);
    the file is written inside a marked temporary directory beside it and renamed over it at the end
    (core.format.staging), so an error, Ctrl-C or SIGTERM leaves no partial file and a SIGKILL's
    leftover is removed by the next write there."""
    model_dir = Path(model_dir)
    output = check_output(Path(output_file), model_dir)
    config, spec, tokenizer_json, tok_config = read_model_dir(model_dir)
    dtype = flm_dtype or default_dtype(config)
    if not (dtype in FLM_DTYPES or flm_encode.parse_group(dtype)):
        raise ConfigError(f"--flm_dtype {dtype!r}: expected one of {', '.join(FLM_DTYPES)}")
    entries, flags = vocab_entries(tokenizer_json) if tokenizer_json is not None else ([], {})
    info = {**model_info(config, tokenizer_json, tok_config), **flags, EXPORT_KEY: EXPORT_PLACEHOLDER,
            ACT_QUANT_KEY: config.quantization.activation_quant or "none"}  # read back by core.sources.flm_source
    with staged_file(output, lambda: check_output(output, model_dir), "--output_file") as tmp:
        _write_flm(tmp, info, entries, model_dir, config, spec, dtype, show_progress)
    return output


def _write_flm(path: Path, info: dict[str, str], entries: list[tuple[bytes, int, float]], model_dir: Path,
               config, spec, dtype: str, show_progress: bool) -> None:
    """The .flm file at `path`: info, vocab, every tensor, then the count and EXPORT_KEY's digest patched in."""
    table = info_table(info)
    with open(path, "wb") as f, progress(show_progress) as bar:
        f.write(table)
        f.write(vocab_table(entries))
        count_at = f.tell()
        f.write(pack_int(0))  # tensor count, patched at the end
        count = 0
        task = bar.add_task("export", total=None)
        for name, bundle, is_linear in hf_tensors(model_dir, config, spec):
            f.writelines(flm_encode.tensor_parts(name, bundle, dtype if is_linear else flm_encode.plain_dtype(dtype)))
            count += 1
            bar.advance(task)
        f.seek(count_at)
        f.write(pack_int(count))
    write_mark(path, 8, len(table))
