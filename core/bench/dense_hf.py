"""A dense HF directory from a GGUF file: the baseline a transformers user runs.

transformers 5 loading a GGUF (`gguf_file=`) keeps its weights packed and dequantizes them per
matmul, which is not what a transformers user runs. Here the GGUF is read by bestiary's own
source (core.sources), its tensors dequantized once and saved under their HF names with the
HF config and tokenizer: a plain `save_pretrained`-style directory. FastLLM 1.9.0 fails on tied
embeddings ("Linear's weight's shape's size should be 2"): `untied=True` writes lm_head.weight
and tie_word_embeddings false for it.

Directories made for the cache (`dense_hf_dir(gguf)`) live under <cache>/dense-hf/, keyed by
the GGUF's path, size and mtime, the dtype and tying; they are written to a temporary folder and
renamed into place, so a half-written one is never used.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from bestiary.core.format.cache import cache_dir, source_key


def write_dense_hf(gguf: Path, out: Path, dtype: torch.dtype = torch.float32, untied: bool = False) -> Path:
    """Write `gguf` as an HF dir `out` (model.safetensors, config.json, tokenizer files) in `dtype`."""
    from safetensors.torch import save_file

    from bestiary.core.sources import open_source

    src = open_source(gguf)
    names = list(src.weights.keys())
    tensors = {k: src.weights.load(k).to(dtype).contiguous() for k in names}
    tied = "lm_head.weight" not in tensors
    if untied and tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    if src.tokenizer is not None:
        tok = json.loads(src.tokenizer.tokenizer_json)
        merges = tok.get("model", {}).get("merges")
        if merges:  # "a b" strings: the form every reader (FastLLM's exporter included) accepts
            tok["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in merges]
        (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        (out / "tokenizer_config.json").write_text(json.dumps(src.tokenizer.tokenizer_config))
    config = {**src.hf_config, "torch_dtype": str(dtype).removeprefix("torch.")}
    if untied or not tied:
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def dense_hf_dir(gguf: str | Path, dtype: torch.dtype = torch.float32, untied: bool = False) -> Path:
    """The cached dense HF dir of `gguf` (made on first use)."""
    gguf = Path(gguf)
    tag = f"{str(dtype).removeprefix('torch.')}-{'untied' if untied else 'tied'}"
    out = cache_dir() / "dense-hf" / f"{source_key(gguf, [gguf], tag)}-{gguf.stem}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_dense_hf(gguf, tmp, dtype, untied)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():  # not another process's finished copy
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
