"""Opening a model source: HF directory, single .safetensors/.bin/.pth file, GGUF, or FastLLM .flm.

`open_source(path)` detects the format and returns a `ModelSource`.

Layer 1 of the core (docs/architecture.md). May import: format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.hf_fields import check_hf_fields
from bestiary.core.sources.base import ModelSource, TokenizerFiles, WeightSource, slice_dim

__all__ = ["ModelSource", "TokenizerFiles", "WeightSource", "open_source", "slice_dim", "source_files"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")
# What open_source reads beside the weights of an HF directory or a single weights file.
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "generation_config.json")


def source_files(path: str | Path) -> list[Path]:
    """Every file `open_source(path)` may read: a .gguf itself; a weights file and the side files
    beside it; every file of an HF directory (weights, configs, tokenizer files)."""
    path = Path(path)
    if not path.exists():
        raise BestiaryError(f"{path}: no such file or directory")
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    if path.suffix == ".gguf":
        return [path]
    return [path, *(path.parent / n for n in SIDE_FILES if (path.parent / n).is_file())]


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of an HF directory: safetensors first, then .bin, then .pth/.pt."""
    for suffix in WEIGHT_SUFFIXES:
        files = sorted(p for p in directory.glob(f"*{suffix}") if not p.name.startswith("training_args"))
        if files:
            return files
    raise BestiaryError(f"{directory}: no weight files (*.safetensors, *.bin, *.pth) found")


def _open_weights(files: list[Path]) -> tuple[str, WeightSource]:
    if files[0].suffix == ".safetensors":
        from bestiary.core.sources.safetensors_source import SafetensorsWeights

        return "safetensors", SafetensorsWeights(files)
    from bestiary.core.sources.torch_source import TorchWeights

    return "torch", TorchWeights(files)


def hf_tokenizer_files(directory: Path) -> TokenizerFiles | None:
    """tokenizer.json (+ tokenizer_config.json, special_tokens_map.json) of an HF directory, if any."""
    tok = directory / "tokenizer.json"
    if not tok.is_file():
        return None
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            config.update(read_json(directory / name))
    template = directory / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = _utf8(template)
    gen = directory / "generation_config.json"
    if gen.is_file():
        config.setdefault("generation_eos_token_id", read_json(gen).get("eos_token_id"))
    return TokenizerFiles(_utf8(tok), config)


def _utf8(path: Path) -> str:
    """A text file the tokenizer needs; not UTF-8 is a one-line error naming it."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise BestiaryError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})") from None


def open_source(path: str | Path) -> ModelSource:
    """Open an HF directory, a .gguf file, or a .safetensors/.bin/.pth file with config.json beside it."""
    path = Path(path)
    if not path.exists():
        raise BestiaryError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix == ".gguf":
        from bestiary.core.sources.gguf_source import open_gguf

        return open_gguf(path)
    if path.is_file() and path.suffix == ".flm":
        from bestiary.core.sources.flm_source import open_flm

        return open_flm(path)
    if path.is_file():
        if path.suffix not in WEIGHT_SUFFIXES:
            raise BestiaryError(
                f"{path}: unknown model file type {path.suffix!r}; expected an HF directory, .gguf, .flm, "
                ".safetensors, .bin or .pth"
            )
        directory, files = path.parent, [path]
    else:
        directory, files = path, None
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise BestiaryError(f"{directory}: no config.json (expected an HF model directory or a .gguf file)")
    hf_config = read_json(config_path)
    check_hf_fields(hf_config, str(config_path))  # types and ranges, before any family reads a field
    files = files or _weight_files(directory)
    fmt, weights = _open_weights(files)
    if _mxfp4(hf_config):  # OCP MXFP4 tensors (gpt-oss's experts): read dequantized, a float source
        from bestiary.core.sources.mxfp4 import Mxfp4Weights

        weights = Mxfp4Weights(weights)
        hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    return ModelSource(path=path, format=fmt if path.is_file() else "hf_dir", weights=weights,
                       hf_config=hf_config, tokenizer=_tokenizer_files(directory, hf_config))


def _mxfp4(hf_config: dict[str, Any]) -> bool:
    """Whether the source config says its quantized tensors are MXFP4 (core.sources.mxfp4)."""
    qc = hf_config.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def _tokenizer_files(directory: Path, hf_config: dict[str, Any]) -> TokenizerFiles | None:
    """tokenizer.json, else a sentencepiece model (tokenizer.model, THUDM's ice_text.model) converted."""
    found = hf_tokenizer_files(directory)
    if found is not None:
        return found
    from bestiary.core.sources.sp_model import sentencepiece_tokenizer_files

    return sentencepiece_tokenizer_files(directory, hf_config)

