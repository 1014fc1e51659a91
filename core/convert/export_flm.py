"""`bestiary export --format flm`: a checkpoint or engine dir -> one FastLLM `.flm` file.

1. Read the dir's config.json (a checkpoint's, or an engine's pretrained_config) and its tokenizer;
   only single-rank models are exported (FastLLM files hold whole tensors).
2. Model info: the HF config of the architecture (`hf_config_of`, tables in
   core.convert.flm_tables), the chat template, and bestiary's tokenizer.json / tokenizer_config
   under `bestiary.*` keys (FastLLM ignores them; `bestiary convert` reads them back exactly).
   Vocab: every token with a score (BPE: -merge rank for merged tokens, 1 else; unigram: its score).
3. Tensors, one at a time from rank0.safetensors (resident memory: the current layer's tensors),
   under HF names: the architecture's key map translates each canonical key, and the inverse of
   its postprocess hook (`flm_tables.INVERSE_HOOKS`) splits fused rows (qkv -> q, k, v;
   [Q; K; V] -> per-head order; gate + up -> dense_h_to_4h).
4. Each Linear weight in `--flm_dtype` (default: the layout it has): codes are copied exactly
   when the layout allows (W8A16 -> int8; W4A16 with integer zero points -> int4 grouped; per-row
   int4 when every group of a row shares (s, z)), otherwise the dequantized weight is quantized
   with FastLLM's own rule and the error it adds is printed. Other tensors: float32 (float16
   when --flm_dtype float16), as FastLLM's exporter writes them.
5. The file is written as a temporary sibling and renamed over `output_file` at the end, so an
   error or Ctrl-C leaves no partial file; an existing output that is not a .flm is never replaced.
"""

from __future__ import annotations

import fnmatch
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch

from bestiary.core.convert import flm_encode
from bestiary.core.convert.flm_tables import INVERSE_HOOKS, hf_config_of
from bestiary.core.convert.progress import progress
from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError, ConfigError, EnvironmentFault
from bestiary.core.sources.flm_format import VERSION, pack_int, pack_string, pack_token

FLM_DTYPES = ("float32", "float16", "int8", "int4", "int4g128")


# ---- reading the model dir -----------------------------------------------------------------------


def read_model_dir(directory: Path):
    """(config, spec, tokenizer json text or None, tokenizer_config) of a checkpoint or engine dir."""
    from bestiary.core.runtime.engine import validate_model_config
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
    spec = default_registry().get(config.architecture)
    tok = directory / "tokenizer.json"
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.is_file() else {}
    return config, spec, tok.read_text() if tok.is_file() else None, tok_config


# ---- header and vocab ----------------------------------------------------------------------------


def vocab_entries(tokenizer_json: str) -> tuple[list[tuple[bytes, int, float]], dict[str, str]]:
    """(entries, tokenizer info flags) of a tokenizer.json, scored the way FastLLM's exporter scores."""
    data = json.loads(tokenizer_json)
    model = data["model"]
    flags: dict[str, str] = {"tokenizer_use_score": "1"}
    if model["type"] == "Unigram":
        entries = [(piece.encode(), i, float(score)) for i, (piece, score) in enumerate(model["vocab"])]
    else:
        merged: dict[str, float] = {}
        for rank, merge in enumerate(model.get("merges", [])):
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


def header_bytes(info: dict[str, str], entries: list[tuple[bytes, int, float]]) -> bytes:
    out = [pack_int(VERSION, len(info))]
    for key in sorted(info):
        out += [pack_string(key), pack_string(info[key])]
    out.append(pack_int(len(entries)))
    out += [pack_token(piece, token_id, score) for piece, token_id, score in entries]
    return b"".join(out)


# ---- tensors -------------------------------------------------------------------------------------


def _linears(spec, config) -> dict[str, object]:
    """module path -> Linear of the single-rank model (on the meta device)."""
    from bestiary.core.convert.source_to_checkpoint import instantiate
    from bestiary.core.layers.linear import Linear

    model = instantiate(spec, config, 0)
    return {path: m for path, m in model.named_modules() if isinstance(m, Linear)}


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
    linears = _linears(spec, config)
    pending: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    path = directory / "rank0.safetensors"
    if not path.is_file():
        raise BestiaryError(f"{directory}: no rank0.safetensors")
    with SafetensorsStream(path) as f:
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


class SafetensorsStream:
    """Tensors of a .safetensors file read one at a time with plain reads (a memory map would keep every
    page it touched resident): 8-byte header length, JSON header, then each tensor's byte range."""

    DTYPES: ClassVar[dict[str, torch.dtype]] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn}

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        (size,) = struct.unpack("<Q", self.file.read(8))
        self.header = {k: v for k, v in json.loads(self.file.read(size)).items() if k != "__metadata__"}
        self.base = 8 + size

    def __enter__(self) -> SafetensorsStream:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return list(self.header)

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self.header[key]
        start, end = entry["data_offsets"]
        self.file.seek(self.base + start)
        data = bytearray(self.file.read(end - start))
        dtype = self.DTYPES[entry["dtype"]]
        if not data:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])


def check_output(output: Path) -> Path:
    """`output` must end in .flm and, if it exists, be a .flm file (never replace anything else)."""
    output = Path(output)
    if output.suffix != ".flm":
        raise BestiaryError(f"--output_file {output}: expected a file name ending in .flm")
    if output.is_dir():
        raise BestiaryError(f"--output_file {output}: is a directory")
    if output.exists():
        with open(output, "rb") as f:
            head = f.read(4)
        if len(head) != 4 or struct.unpack("<i", head)[0] != VERSION:
            raise BestiaryError(f"--output_file {output}: exists and is not a .flm file; not replacing it")
    return output


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
    """Write `model_dir` (checkpoint or engine dir) as the FastLLM file `output_file`; returns its path."""
    model_dir = Path(model_dir)
    output = check_output(Path(output_file))
    config, spec, tokenizer_json, tok_config = read_model_dir(model_dir)
    dtype = flm_dtype or default_dtype(config)
    if not (dtype in FLM_DTYPES or flm_encode.parse_group(dtype)):
        raise ConfigError(f"--flm_dtype {dtype!r}: expected one of {', '.join(FLM_DTYPES)}")
    entries, flags = vocab_entries(tokenizer_json) if tokenizer_json is not None else ([], {})
    info = {**model_info(config, tokenizer_json, tok_config), **flags,
            ACT_QUANT_KEY: config.quantization.activation_quant or "none"}  # read back by core.sources.flm_source
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f, progress(show_progress) as bar:
            f.write(header_bytes(info, entries))
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
        os.replace(tmp, output)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise EnvironmentFault(f"--output_file {output}: writing failed ({err.strerror or err}); "
                                   "nothing was written") from None
        raise
    return output
