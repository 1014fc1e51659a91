"""Real-size synthetic models for `bestiary bench --shape`: LLaMA shapes with seeded random weights.

A published model's shape (its HF config fields: layers, widths, heads, vocabulary, RoPE) is what
decides a benchmark's speed, not its weights' values; random weights need no download. For a shape
(SHAPES) this module makes, once each, into `<cache>/synthetic/<shape>-<key>/`:

- `source/`: an HF model dir (config.json + model.safetensors, bf16, no tokenizer: bench's prompts
  are token ids) whose weights are N(0, STD^2) draws seeded per tensor (norm weights 1), written
  tensor by tensor, a row chunk at a time (never a whole model in memory);
- `<shape>-<mode>/`: the engine, the source converted and built (core.convert) as bf16, W8A16 (int8 per output
  channel) or W4A16 (int4, groups of 128, round to nearest: GPTQ's calibration fits real weights
  to real text and would only cost time on random ones);
- `<shape>-<QTYPE>.gguf`: the same weights as llama.cpp stores them, written by gguf-py: q / k rows
  permuted as llama.cpp's converter does (`gguf_permute`), norms F32, a synthetic SentencePiece
  vocabulary of the shape's size. Q8_0: every matrix Q8_0, token_embd and output included
  (`convert_hf_to_gguf.py --outtype q8_0`). Q4_1: every matrix Q4_1, token_embd included, as
  `llama-quantize ... Q4_1` stores them, except output.weight (token_embd when tied), which
  llama-quantize stores as Q6_K and gguf-py cannot write (gguf.quants has no Q6_K or Q4_K
  quantizer): Q8_0 there (`llama-quantize --output-tensor-type q8_0`).

`<key>` hashes the shape's config, the seed and STD: a changed definition makes a new directory.
Each artifact is written into a temporary name beside it and renamed when whole, so a present one
is complete and reused as it is; before writing, the free disk space must hold its estimated size
(`need_disk`), else a one-line BestiaryError.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bestiary.core.format.cache import cache_dir
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from bestiary.core.format.build_config import BuildConfig
    from bestiary.core.format.config import QuantConfig

STD = 0.02  # the weights' standard deviation (HF's initializer_range)
SEED = 0
CHUNK_ELEMENTS = 1 << 24  # a tensor is drawn, read and quantized this many elements at a time (64 MB in fp32)
DISK_MARGIN = 1 << 30  # free bytes left after the biggest artifact
MODES = ("bf16", "w8a16", "w4a16", "w8a8", "w4a8")  # w8a8 / w4a8: W8A16 / W4A16 weights, int8 activations per token
# and 64 features
DEFAULT_MODES = ("bf16", "w8a16", "w4a16")
GGUF_TYPES = ("Q8_0", "Q4_1")
FORMAT_VERSION = 1  # in the cache key: bump it when what is written changes (engine_build's limits too)

Progress = Callable[[str, int, int], None]  # (what, done, total): called as tensors are written


@dataclass(frozen=True)
class Shape:
    """A LLaMA-architecture shape: the fields of its HF config.json (head_dim = hidden / heads)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5
    like: str = ""  # the published model it is the shape of

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hf_config(self) -> dict[str, Any]:
        """config.json of the source (LlamaForCausalLM, bf16; bos 1, eos 2 of the synthetic vocabulary)."""
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 1, "eos_token_id": 2, "initializer_range": STD, "torch_dtype": "bfloat16",
        }
        return config

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every weight, in the order they are written."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (v, h)))
        return out

    def params(self) -> int:
        """Number of weights (a tied embedding once)."""
        return sum(math.prod(s) for _, s in self.tensors())

    def key(self) -> str:
        """8 hex digits of sha256(config, seed, std, format version): the cache directory's suffix."""
        text = json.dumps([self.hf_config(), SEED, STD, FORMAT_VERSION], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # meta-llama/Llama-3.2-3B's config.json

SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000, like="TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    Shape("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, rope_theta=500000.0, max_position_embeddings=131072,
          tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, like="meta-llama/Llama-3.2-3B"),
    Shape("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, max_position_embeddings=4096,
          like="meta-llama/Llama-2-7b-hf"),
    Shape("tiny", 128, 2, 4, 2, 256, 320, max_position_embeddings=256, like="the tests' shape, made in a second"),
)}


def shape_named(name: str, flag: str = "--shape") -> Shape:
    """SHAPES[name], or a one-line error naming the known shapes."""
    if name not in SHAPES:
        raise BestiaryError(f"{flag} {name}: unknown shape; expected one of {', '.join(SHAPES)}")
    return SHAPES[name]


def shape_dir(shape: Shape, cache: Path | None = None) -> Path:
    """<cache>/synthetic/<name>-<key>: where a shape's artifacts live (cache: default core.format.cache)."""
    return (cache if cache is not None else cache_dir() / "synthetic") / f"{shape.name}-{shape.key()}"


def source_path(shape: Shape, cache: Path | None = None) -> Path:
    return shape_dir(shape, cache) / "source"


def engine_path(shape: Shape, mode: str, cache: Path | None = None) -> Path:
    return shape_dir(shape, cache) / f"{shape.name}-{mode}"  # the bench row's label: bestiary <shape>-<mode>


def gguf_path(shape: Shape, qtype: str, cache: Path | None = None) -> Path:
    return shape_dir(shape, cache) / f"{shape.name}-{qtype}.gguf"


# --- disk ------------------------------------------------------------------------------------------------
def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def need_disk(where: Path, nbytes: int, what: str) -> None:
    """Refuse in one line when the filesystem of `where` has less than nbytes + DISK_MARGIN free."""
    existing = next(p for p in (where, *where.parents) if p.exists())  # where it will be: nothing made yet
    free = shutil.disk_usage(existing).free
    if free < nbytes + DISK_MARGIN:
        raise BestiaryError(f"{where}: {gib(free)} free; {what} needs about {gib(nbytes)} "
                            f"(+ {gib(DISK_MARGIN)} margin): free some space or pass --cache_dir on another disk")


def estimated_bytes(shape: Shape, what: str) -> int:
    """Bytes an artifact takes: bf16 source / engine 2 per weight; w8a16 1 per linear weight (the lm_head one too,
    tied or not: the engine holds it quantized beside the bf16 embedding), w4a16 1/2 (+ scales), the embedding
    and norms bf16; GGUF Q8_0 34 bytes per 32 weights, Q4_1 20 per 32 (its output Q8_0). Within 0.2% of the
    made files at 1.1B, 3B and 7B (tests/bench/test_synthetic_shapes.py)."""
    n, vh = shape.params(), shape.vocab_size * shape.hidden_size
    quantized = n - vh * (1 if shape.tie_word_embeddings else 2) + vh  # every linear, the lm_head included
    per = {"source": 2 * n, "bf16": 2 * n, "w8a16": quantized + 2 * vh + 4 * quantized // shape.hidden_size,
           "w4a16": quantized // 2 + 2 * vh + 2 * quantized // 128, "Q8_0": n * 34 // 32,
           "Q4_1": (n - vh) * 20 // 32 + vh * 34 // 32}
    per["w8a8"], per["w4a8"] = per["w8a16"], per["w4a16"]  # the same weights; activations quantized at run time
    return per[what]


def unmade(shape: Shape, modes: list[str], qtypes: list[str], cache: Path | None = None) -> list[str]:
    """The engines of `modes` and GGUFs of `qtypes` of `shape` not made yet (each is staged, so it exists only
    once complete); the source is only read to make them."""
    return ([m for m in modes if not engine_path(shape, m, cache).exists()]
            + [q for q in qtypes if not gguf_path(shape, q, cache).exists()])


def missing_bytes(shape: Shape, modes: list[str], qtypes: list[str], cache: Path | None = None) -> int:
    """Estimated bytes of the artifacts of `shape` (source, engines of `modes`, GGUFs of `qtypes`) not yet made."""
    todo = unmade(shape, modes, qtypes, cache)
    if todo and not source_path(shape, cache).exists():
        todo.append("source")
    return sum(estimated_bytes(shape, what) for what in todo)


@contextmanager
def staged(final: Path) -> Iterator[Path]:
    """A temporary path beside `final` (same filesystem) renamed to `final` when the block ends without
    an error; removed otherwise. A path that exists at `final` is only ever a whole artifact."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    target = tmp / final.name
    try:
        yield target
        target.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- the source -------------------------------------------------------------------------------------------
def tensor_rows(shape: tuple[int, ...]) -> int:
    """Rows drawn / read / quantized at once: about CHUNK_ELEMENTS elements, at least one row."""
    row = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return max(1, CHUNK_ELEMENTS // row)


def draw(name: str, shape: tuple[int, ...], index: int) -> Iterator[torch.Tensor]:
    """Tensor `index` of a source in row chunks, bf16: ones for a norm weight (1-D), else N(0, STD^2)
    drawn from a generator seeded with SEED * 1_000_003 + index (the same tensor every time)."""
    import torch

    if len(shape) == 1:
        yield torch.ones(shape, dtype=torch.bfloat16)
        return
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + index)
    step = tensor_rows(shape)
    for start in range(0, shape[0], step):
        rows = min(step, shape[0] - start)
        yield (torch.randn((rows, *shape[1:]), generator=gen) * STD).to(torch.bfloat16)  # [rows, in]


def safetensors_header(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """The 8-byte length + JSON header of a bf16 .safetensors file holding `tensors` in order, padded
    with spaces to a multiple of 8 (as safetensors writes it)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_source(shape: Shape, out: Path, progress: Progress | None = None) -> None:
    """config.json + model.safetensors of `shape` into the new dir `out`, tensor by tensor."""
    import torch

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=1) + "\n")
    tensors = shape.tensors()
    with open(out / "model.safetensors", "wb") as f:
        f.write(safetensors_header(tensors))
        for i, (name, dims) in enumerate(tensors):
            for chunk in draw(name, dims, i):
                chunk.view(torch.int16).numpy().tofile(f)  # the bf16 bits, little-endian
            if progress is not None:
                progress("source", i + 1, len(tensors))


def synthetic_source(shape: Shape, cache: Path | None = None, progress: Progress | None = None) -> Path:
    """The HF source dir of `shape` (made once: `<shape_dir>/source`)."""
    final = source_path(shape, cache)
    if (final / "model.safetensors").is_file():
        return final
    need_disk(final.parent, estimated_bytes(shape, "source"), f"the {shape.name} bf16 source")
    with staged(final) as tmp:
        write_source(shape, tmp, progress)
    return final


# --- engines ----------------------------------------------------------------------------------------------
def mode_quantization(mode: str) -> QuantConfig | None:
    """The checkpoint's quantization section of an engine mode (None: bf16 weights)."""
    from bestiary.core.format.config import QuantConfig

    if mode == "bf16":
        return None
    if mode == "w8a16":
        return QuantConfig(quant_algo="W8A16")
    if mode == "w4a16":
        return QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=False)
    if mode == "w8a8":
        return QuantConfig(quant_algo="W8A16", activation_quant="int8")
    if mode == "w4a8":
        return QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=False, activation_quant="int8")
    raise BestiaryError(f"--modes {mode}: unknown engine mode; expected some of {', '.join(MODES)}")


def engine_build(shape: Shape) -> BuildConfig:
    """The build limits of a synthetic engine: sequences of up to min(positions, 4096) tokens, prompts of
    up to one less, a KV pool of 16384 tokens (the same for every shape: a 128k-position model's default
    pool, max_batch_size x positions, would not fit a host)."""
    from bestiary.core.format.build_config import BuildConfig

    seq = min(shape.max_position_embeddings, 4096)
    return BuildConfig(max_seq_len=seq, max_input_len=seq - 1, max_tokens_in_paged_kv_cache=16384)


def synthetic_engine(shape: Shape, mode: str, cache: Path | None = None, show_progress: bool = False) -> Path:
    """The engine dir of `shape` in `mode` (made once: `<shape_dir>/<shape>-<mode>`), from its source."""
    from bestiary.core.convert.checkpoint_to_engine import build_engine
    from bestiary.core.convert.options import ConvertOptions
    from bestiary.core.convert.source_to_checkpoint import convert

    quant = mode_quantization(mode)
    final = engine_path(shape, mode, cache)
    if (final / "config.json").is_file():
        return final
    source = synthetic_source(shape, cache)
    need_disk(final.parent, estimated_bytes(shape, mode), f"the {shape.name} {mode} engine")
    options = ConvertOptions(dtype="bfloat16", quantization=quant, weight_quantizer="rtn" if quant else None)
    with staged(final) as tmp:
        ckpt = tmp.with_name("checkpoint")
        convert(source, ckpt, options, show_progress=show_progress)
        build_engine(ckpt, tmp, engine_build(shape))  # the rank files hard-linked: the checkpoint costs nothing
    return final


def synthetic_engines(shape: Shape, modes: list[str], cache: Path | None = None,
                      show_progress: bool = False) -> dict[str, Path]:
    """{mode: engine dir} of `shape` for each of `modes` (each made once)."""
    for mode in modes:
        mode_quantization(mode)  # an unknown mode is refused before anything is made
    return {mode: synthetic_engine(shape, mode, cache, show_progress) for mode in modes}


# --- llama.cpp GGUFs --------------------------------------------------------------------------------------
def gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: within each head, HF's rotate-half order
    (first half, second half) becomes interleaved pairs: rows [h, 2, d/2] -> [h, d/2, 2]. w: [heads * d, in]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name of an HF LLaMA weight."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def gguf_qtype(shape: Shape, hf: str, qtype: str):
    """The GGML type a weight is stored as in a `qtype` file (module docstring): norms F32; the output
    matrix (the embedding when tied) Q8_0 in Q4_1 files; every other matrix `qtype`."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if hf.endswith("norm.weight"):
        return Q.F32
    is_output = hf == "lm_head.weight" or (shape.tie_word_embeddings and hf == "model.embed_tokens.weight")
    return Q.Q8_0 if is_output else Q[qtype]


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of `size` tokens: <unk> <s> </s>, the 256 byte tokens, then pieces
    '▁t<i>' scored -i (tokens, scores, llama.cpp token types)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3] + [6] * 256
    if size < len(tokens):
        raise BestiaryError(f"vocab_size {size}: a synthetic vocabulary needs at least {len(tokens)} tokens")
    n = size - len(tokens)
    scores = [0.0] * len(tokens) + [-float(i) for i in range(n)]
    return tokens + [f"▁t{i}" for i in range(n)], scores, types + [1] * n


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for llama3 RoPE scaling: per frequency
    f_i = theta^(-2i/d), wavelength 2 pi / f_i: 1 below old_ctx / high_freq_factor, `factor` above
    old_ctx / low_freq_factor, 1 / ((1 - s) / factor + s) between, s = (old_ctx / wavelength - low) / (high - low)."""
    import numpy as np

    rs = shape.rope_scaling or {}
    d, factor = shape.head_dim, rs["factor"]
    low, high, old = rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))  # [d/2]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def gguf_metadata(writer, shape: Shape, qtype: str) -> None:
    """The llama architecture and tokenizer keys llama.cpp reads (file_type: the ftype's number)."""
    import gguf

    writer.add_name(f"synthetic {shape.name}")
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    tokens, scores, types = spm_vocab(shape.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def gguf_rows(weights, shape: Shape, hf: str, dims: tuple[int, ...]) -> Iterator[np.ndarray]:
    """The float32 rows of weight `hf` as llama.cpp stores them (q / k permuted per head), in chunks
    of whole heads. weights: a safetensors handle on the source."""
    heads = {"q_proj": shape.num_attention_heads, "k_proj": shape.num_key_value_heads}
    kind = next((k for k in heads if f".{k}." in hf), None)
    part = weights.get_slice(hf)
    if kind is not None:  # q / k: permuted whole, [heads * d, hidden] is small
        yield gguf_permute(part[:].float().numpy(), heads[kind])
        return
    step = tensor_rows(dims)
    for start in range(0, dims[0], step):
        yield part[start:start + step].float().numpy()  # [rows, in] (a 1-D norm: one chunk)


def write_gguf(shape: Shape, source: Path, out: Path, qtype: str, progress: Progress | None = None) -> None:
    """The GGUF of `source` (shape's weights) stored as `qtype`, tensor by tensor."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    tensors = shape.tensors()
    writer = gguf.GGUFWriter(str(out), "llama")
    gguf_metadata(writer, shape, qtype)
    extra = {"rope_freqs.weight": llama3_rope_factors(shape)} if shape.rope_scaling else {}
    for name, data in extra.items():
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes)
    for hf, dims in tensors:
        q = gguf_qtype(shape, hf, qtype)
        if q == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(gguf_name(hf), dims, np.dtype(np.float32), 4 * math.prod(dims))
            continue
        nbytes = math.prod(gguf.quants.quant_shape_to_byte_shape(dims, q))
        writer.add_tensor_info(gguf_name(hf), gguf.quants.quant_shape_to_byte_shape(dims, q), np.dtype(np.uint8),
                               nbytes, raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in extra.values():
        writer.write_tensor_data(data)
    with safe_open(str(source / "model.safetensors"), framework="pt") as weights:
        for i, (hf, dims) in enumerate(tensors):
            q = gguf_qtype(shape, hf, qtype)
            parts = [rows if q == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(rows, q)
                     for rows in gguf_rows(weights, shape, hf, dims)]
            writer.write_tensor_data(np.concatenate(parts) if len(parts) > 1 else parts[0])
            if progress is not None:
                progress(f"gguf {qtype}", i + 1, len(tensors))
    writer.close()


def synthetic_gguf(shape: Shape, qtypes: list[str], cache: Path | None = None,
                   progress: Progress | None = None) -> dict[str, Path]:
    """{qtype: GGUF file} of `shape`'s source weights, each made once (`<shape_dir>/<shape>-<qtype>.gguf`)."""
    for qtype in qtypes:
        if qtype not in GGUF_TYPES:
            raise BestiaryError(f"--gguf_types {qtype}: gguf-py cannot write it; expected some of "
                                f"{', '.join(GGUF_TYPES)} (gguf.quants has no K-quant quantizer)")
    out = {}
    for qtype in qtypes:
        final = gguf_path(shape, qtype, cache)
        if not final.is_file():
            source = synthetic_source(shape, cache, progress)
            need_disk(final.parent, estimated_bytes(shape, qtype), f"the {shape.name} {qtype} GGUF")
            with staged(final) as tmp:
                write_gguf(shape, source, tmp, qtype, progress)
        out[qtype] = final
    return out


def artifact_bytes(path: Path) -> int:
    """Bytes of a file, or of the files under a dir (each inode once: hard links counted once)."""
    if path.is_file():
        return path.stat().st_size
    seen: dict[tuple[int, int], int] = {}
    for p in path.rglob("*"):
        if p.is_file():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())

