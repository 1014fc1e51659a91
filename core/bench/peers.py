"""Peer systems for `bestiary bench --compare`: HF transformers, llama.cpp, FastLLM.

Each is optional: a missing package or model file makes its rows "skipped: <reason>", never a
crash. Every peer runs the same calls as an engine (core.bench.systems.System):

- hf: transformers on a dense HF dir (a GGUF is first made dense, core.bench.dense_hf), one row
  per dtype; the mixed workload as static batches (left-padded, each batch run to its longest
  output; only the tokens a request asked for are counted; latency = its batch's end).
- llama.cpp: llama-cpp-python on each GGUF given, with its own build flags in the label; no
  batched API, so no mixed row.
- fastllm: ftllm on a dense HF dir with an untied lm_head, one row per dtype (float16, int8,
  int4 quantized by ftllm at load); the mixed workload through its own continuous batching.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bestiary.core.bench.systems import System
from bestiary.core.bench.workload import MixedResult, Timed, Workload

PEER_NAMES = ("hf", "llama.cpp", "fastllm")
PACKAGES = {"hf": ("transformers", "transformers"), "llama.cpp": ("llama_cpp", "llama-cpp-python"),
            "fastllm": ("ftllm", "ftllm")}


class PeerSkipped(Exception):
    """A peer that cannot run here; the message says why (one line)."""


@dataclass
class PeerOptions:
    """Where the peers' models are and how they run."""

    hf_model: Path | None = None  # HF dir or .gguf (made dense) for hf and fastllm
    hf_dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    gguf: list[Path] = field(default_factory=list)  # llama.cpp model files
    fastllm_dtypes: list[str] = field(default_factory=lambda: ["float16", "int8", "int4"])
    num_threads: int = 1
    static_batch: int = 16  # hf's mixed workload: static batches of this many requests
    n_ctx: int = 2048  # llama.cpp context: the longest prompt + output the run needs


@dataclass
class Candidate:
    """One row of the run: a system to open (or the reason it is skipped)."""

    name: str
    label: str
    open: Callable[[], System] | None = None
    skipped: str | None = None
    plain: Candidate | None = None  # a speculative engine row: the same engine's plain row (same output)


def require(peer: str):
    """Import a peer's package, or PeerSkipped naming what to install."""
    module, dist = PACKAGES[peer]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise PeerSkipped(f"{dist} is not installed (pip install {dist}, or the bench extra)") from None


def candidates(compare: list[str], opts: PeerOptions) -> list[Candidate]:
    """The rows of every peer in `compare` (unknown names were refused by the CLI)."""
    rows: list[Candidate] = []
    for peer in compare:
        try:
            rows += {"hf": _hf_rows, "llama.cpp": _llama_cpp_rows, "fastllm": _fastllm_rows}[peer](opts)
        except PeerSkipped as why:
            rows.append(Candidate(peer, peer, skipped=str(why)))
    return rows


def check_hf_model(opts: PeerOptions, peer: str) -> Path:
    """--hf_model; PeerSkipped unless it is an HF dir or a .gguf file."""
    if opts.hf_model is None:
        raise PeerSkipped(f"no --hf_model (an HF dir, or a .gguf made dense once) for {peer}")
    if not (opts.hf_model.suffix == ".gguf" and opts.hf_model.is_file()) and \
            not (opts.hf_model / "config.json").is_file():
        raise PeerSkipped(f"--hf_model {opts.hf_model}: not an HF dir (no config.json) or a .gguf file")
    return opts.hf_model


def _model_dir(hf_model: Path, untied: bool) -> Path:
    """--hf_model as a dense HF dir (a .gguf made dense once, cached; float16 and untied for FastLLM)."""
    if hf_model.suffix == ".gguf":
        import torch

        from bestiary.core.bench.dense_hf import dense_hf_dir

        return dense_hf_dir(hf_model, torch.float16 if untied else torch.float32, untied=untied)
    return hf_model


# --- HF transformers ---------------------------------------------------------------------
def _hf_rows(opts: PeerOptions) -> list[Candidate]:
    transformers = require("hf")
    hf_model = check_hf_model(opts, "hf")

    def opener(dtype: str) -> Callable[[], System]:
        return lambda: HFSystem(_model_dir(hf_model, untied=False), dtype, opts.static_batch)

    return [Candidate("hf", f"transformers {transformers.__version__} {d} (dense)", opener(d))
            for d in opts.hf_dtypes]


class HFSystem:
    """transformers generate on a dense model, greedy, exactly n new tokens."""

    mixed_note = ""

    def __init__(self, model_dir: Path, dtype: str, static_batch: int = 16) -> None:
        import torch
        import transformers

        self.torch = torch
        self.static_batch = static_batch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype)).eval()
        self.max_prompt_len: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self.bytes_per_token: int | None = _hf_weight_bytes(self.model)

    def _generate(self, ids, mask, n: int) -> None:
        with self.torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)

    def generate(self, prompt: list[int], n: int) -> Timed:
        ids = self.torch.tensor([prompt])
        start = time.perf_counter()
        self._generate(ids, self.torch.ones_like(ids), n)
        return Timed(time.perf_counter() - start, n)  # min_new_tokens = max_new_tokens = n

    def mixed(self, work: Workload) -> MixedResult:
        """Static batches in submit order, left-padded, each run to its longest output."""
        latencies: list[float] = []
        batch = self.static_batch
        start = time.perf_counter()
        for b in range(0, len(work.prompts), batch):
            prompts, news = work.prompts[b: b + batch], work.max_new[b: b + batch]
            width = max(len(p) for p in prompts)
            ids = self.torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = self.torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            self._generate(ids, mask, max(news))
            latencies += [time.perf_counter() - start] * len(prompts)
        return MixedResult(time.perf_counter() - start, latencies, work.asked)

    def close(self) -> None:
        del self.model


def _hf_weight_bytes(model) -> int:
    """Weight bytes read per decoded token: every parameter once, less an untied input embedding."""
    seen, total = set(), 0
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


# --- llama.cpp -----------------------------------------------------------------------------
def llama_cpp_flags() -> str:
    """The llama.cpp build's CPU features (llama_print_system_info), '= 1' entries only."""
    llama_cpp = require("llama.cpp")
    info = llama_cpp.llama_print_system_info().decode()
    return ", ".join(p.split("=")[0].strip() for p in info.split("|") if p.strip().endswith("= 1"))


def _llama_cpp_rows(opts: PeerOptions) -> list[Candidate]:
    require("llama.cpp")
    if not opts.gguf:
        raise PeerSkipped("no --gguf file for llama.cpp")
    flags = llama_cpp_flags()
    rows = []
    for path in opts.gguf:
        if not path.is_file():
            rows.append(Candidate("llama.cpp", f"llama.cpp {path.name}", skipped=f"--gguf {path}: no such file"))
            continue
        rows.append(Candidate("llama.cpp", f"llama.cpp {path.name} [{flags}]",
                              functools.partial(LlamaCppSystem, path, opts.num_threads, opts.n_ctx)))
    return rows


class LlamaCppSystem:
    """llama-cpp-python's Llama.generate, greedy, reset before each call (no prefix reused)."""

    mixed_note = "llama-cpp-python has no batched generate"

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.max_prompt_len: int | None = n_ctx - 1
        self.bytes_per_token: int | None = gguf.stat().st_size  # every tensor is read once per token (tied output)

    def generate(self, prompt: list[int], n: int) -> Timed:
        self.llm.reset()
        start = time.perf_counter()
        for i, _ in enumerate(self.llm.generate(prompt, temp=0.0)):  # (the generator ignores end ids)
            if i + 1 >= n:
                break
        return Timed(time.perf_counter() - start, n)

    def mixed(self, work: Workload) -> None:
        return None

    def close(self) -> None:
        self.llm.close()


# --- FastLLM -------------------------------------------------------------------------------
def _fastllm_rows(opts: PeerOptions) -> list[Candidate]:
    ftllm = require("fastllm")
    hf_model = check_hf_model(opts, "fastllm")
    version = getattr(ftllm, "__version__", "")

    def opener(dtype: str) -> Callable[[], System]:
        return lambda: FastLLMSystem(_model_dir(hf_model, untied=True), dtype, opts.num_threads)

    return [Candidate("fastllm", f"FastLLM {version} {d}".replace("  ", " "), opener(d))
            for d in opts.fastllm_dtypes]


class FastLLMSystem:
    """ftllm's model on a dense HF dir, quantized by ftllm at load; greedy (top_k 1).

    ftllm stops at the model's end ids: a timed call counts the tokens it really generated."""

    mixed_note = ""

    def __init__(self, model_dir: Path, dtype: str, threads: int) -> None:
        import json

        from ftllm import llm

        if json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False):
            raise PeerSkipped(f"{model_dir}: FastLLM 1.9.0 needs an untied lm_head (give --hf_model a .gguf)")
        if not (model_dir / "tokenizer_config.json").is_file():  # ftllm exits the process without one
            raise PeerSkipped(f"{model_dir}: FastLLM needs tokenizer_config.json beside the weights")
        # its pool spins while waiting and the calling thread computes too: `threads` workers on
        # `threads` cores starve it (0.35 tok/s at 2 on 2 cores, 39 at 1: docs/fastllm.md)
        llm.set_cpu_threads(max(1, threads - 1))
        self.model = llm.model(str(model_dir), dtype=dtype)
        self.max_prompt_len: int | None = None
        self.bytes_per_token: int | None = None

    def _launch(self, prompt: list[int], n: int):
        import ctypes

        from ftllm.llm import fastllm_lib

        stop_len, stop_list = self.model.stop_token_ctypes(None)
        one = ctypes.c_float(1)
        return fastllm_lib.launch_response_llm_model(
            self.model.model, len(prompt), (ctypes.c_int * len(prompt))(*prompt), ctypes.c_int(n), ctypes.c_int(0),
            ctypes.c_bool(False), one, ctypes.c_int(1), one, one, ctypes.c_bool(False), stop_len, stop_list)

    def _drain(self, handle) -> int:
        from ftllm.llm import fastllm_lib

        count = 0
        while fastllm_lib.fetch_response_llm_model(self.model.model, handle) > -1:
            count += 1
        return count

    def generate(self, prompt: list[int], n: int) -> Timed:
        start = time.perf_counter()
        tokens = self._drain(self._launch(prompt, n))
        return Timed(time.perf_counter() - start, tokens)

    def mixed(self, work: Workload) -> MixedResult:
        start = time.perf_counter()
        handles = [self._launch(p, n) for p, n in zip(work.prompts, work.max_new, strict=True)]
        latencies, generated = [], 0
        for h in handles:  # in submit order: a request's latency is when its last token was fetched
            generated += self._drain(h)
            latencies.append(time.perf_counter() - start)
        return MixedResult(time.perf_counter() - start, latencies, generated)

    def close(self) -> None:
        del self.model
