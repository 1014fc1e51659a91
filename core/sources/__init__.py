"""Opening a model source: HF directory, single .safetensors/.bin/.pth file, or GGUF.

`open_source(path)` detects the format and returns a `ModelSource`.
"""

from __future__ import annotations

from pathlib import Path

from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError
from bestiary.core.sources.base import ModelSource, TokenizerFiles, WeightSource, slice_dim

__all__ = ["ModelSource", "TokenizerFiles", "WeightSource", "open_source", "slice_dim"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


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
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            config.update(read_json(directory / name))
    template = directory / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text()
    gen = directory / "generation_config.json"
    if gen.is_file():
        config.setdefault("generation_eos_token_id", read_json(gen).get("eos_token_id"))
    return TokenizerFiles(tok.read_text(), config)


def open_source(path: str | Path) -> ModelSource:
    """Open an HF directory, a .gguf file, or a .safetensors/.bin/.pth file with config.json beside it."""
    path = Path(path)
    if not path.exists():
        raise BestiaryError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix == ".gguf":
        from bestiary.core.sources.gguf_source import open_gguf

        return open_gguf(path)
    if path.is_file():
        if path.suffix not in WEIGHT_SUFFIXES:
            raise BestiaryError(
                f"{path}: unknown model file type {path.suffix!r}; expected an HF directory, .gguf, "
                ".safetensors, .bin or .pth"
            )
        directory, files = path.parent, [path]
    else:
        directory, files = path, None
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise BestiaryError(f"{directory}: no config.json (expected an HF model directory or a .gguf file)")
    hf_config = read_json(config_path)
    files = files or _weight_files(directory)
    fmt, weights = _open_weights(files)
    return ModelSource(path=path, format=fmt if path.is_file() else "hf_dir", weights=weights,
                       hf_config=hf_config, tokenizer=hf_tokenizer_files(directory))

