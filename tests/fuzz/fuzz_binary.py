"""Fuzz cases of the binary sources, GGUF and .flm, through `bestiary convert`.

GGUF: bytes damaged; a header count, a field's value type, a tensor's type, dims or data offset
rewritten in place (positions from gguf's reader); or the file written again (fuzz_base.write_gguf)
with a hostile metadata value (wrong type, range, size), a broken tokenizer table (merges naming
missing tokens, malformed merges, duplicate or empty tokens, ids out of range, scores or types of the
wrong length), a tensor missing, extra, of the wrong shape or dtype.
.flm: bytes damaged; a model-info value replaced by hostile text (what ast.literal_eval and JSON make
of it), a key added or removed; the vocab's counts, lengths and ids; a tensor's dims or type code.
"""

from __future__ import annotations

import functools
import random
import struct
from pathlib import Path

import numpy as np
from fuzz_cases import Base, Case, new_case
from fuzz_mutations import damage_bytes


def _put(data: bytes, pos: int, blob: bytes) -> bytes:
    return data[:pos] + blob + data[pos + len(blob) :]


@functools.lru_cache(maxsize=4)
def _gguf_layout(path: str) -> dict:
    """Byte positions in a GGUF: each field's value-type code and first value, each tensor's info."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        type_pos = field.offset + field.parts[0].nbytes + field.parts[1].nbytes
        value_pos = type_pos + 4 + sum(p.nbytes for p in field.parts[3 : field.data[0]]) if field.data else type_pos + 4
        fields[key] = (type_pos, value_pos)
    tensors = []
    for t in reader.tensors:
        parts = t.field.parts  # name_len, name, n_dims, dims, type, offset
        tensors.append({"name": t.name, "ndims_pos": t.field.offset + parts[0].nbytes + parts[1].nbytes,
                        "dims_pos": t.field.offset + sum(p.nbytes for p in parts[:3]),
                        "type_pos": t.field.offset + sum(p.nbytes for p in parts[:4]),
                        "offset_pos": t.field.offset + sum(p.nbytes for p in parts[:5]), "ndims": len(parts[3])})
    return {"fields": fields, "tensors": tensors}


def _gguf_in_place(rng: random.Random, data: bytes, layout: dict) -> str | tuple[str, bytes]:
    op = rng.randrange(6)
    t = rng.choice(layout["tensors"])
    if op == 0:
        pos, name = rng.choice([(8, "tensor count"), (16, "kv count")])
        value = rng.choice([0, 1, 2**31, 2**40, 2**64 - 1])
        return f"{name} {value}", _put(data, pos, struct.pack("<Q", value))
    if op == 1:
        key = rng.choice(sorted(layout["fields"]))
        code = rng.choice([0, 4, 6, 7, 8, 9, 10, 12, 13, 99, 2**32 - 1])
        return f"{key} value type {code}", _put(data, layout["fields"][key][0], struct.pack("<I", code))
    if op == 2:
        key = rng.choice(sorted(layout["fields"]))
        blob = rng.choice([b"\xff" * 8, b"\x00" * 8, struct.pack("<q", -1), struct.pack("<f", float("nan")) * 2])
        return f"{key} value bytes {blob.hex()}", _put(data, layout["fields"][key][1], blob)
    if op == 3:
        qtype = rng.choice([1, 2, 3, 4, 5, 6, 12, 30, 39, 42, 200, 2**31])
        return f"{t['name']} type {qtype}", _put(data, t["type_pos"], struct.pack("<I", qtype))
    if op == 4:
        d = rng.randrange(t["ndims"])
        value = rng.choice([0, 1, 3, 2**31, 2**40, 2**63])
        what = f"{t['name']} dim {d} = {value}"
        if rng.random() < 0.3:
            value = rng.choice([0, 5, 2**32 - 1])
            return f"{t['name']} n_dims {value}", _put(data, t["ndims_pos"], struct.pack("<I", value))
        return what, _put(data, t["dims_pos"] + 8 * d, struct.pack("<Q", value))
    off = rng.choice([1, 3, 31, 2**20, 2**40, 2**64 - 32])
    return f"{t['name']} data offset {off}", _put(data, t["offset_pos"], struct.pack("<Q", off))


def _hostile_gguf_value(rng: random.Random, value, vtype, sub_type):
    """(what, (value, vtype, sub_type)) of a wrong type, range or size for one GGUF key."""
    from gguf import GGUFValueType as T

    choices = [("uint32 0", (0, T.UINT32, None)), ("uint64 2**64-1", (2**64 - 1, T.UINT64, None)),
               ("int32 -1", (-1, T.INT32, None)), ("int64 -2**63", (-(2**63), T.INT64, None)),
               ("float32 nan", (float("nan"), T.FLOAT32, None)), ("float32 inf", (float("inf"), T.FLOAT32, None)),
               ("float32 -1", (-1.0, T.FLOAT32, None)), ("float64 1e308", (1e308, T.FLOAT64, None)),
               ("bool true", (True, T.BOOL, None)), ('string ""', ("", T.STRING, None)),
               ('string "x"', ("x", T.STRING, None)), ("string 100k", ("x" * 100000, T.STRING, None)),
               ("array []", ([], T.ARRAY, T.INT32)), ("array [1, 2]", ([1, 2], T.ARRAY, T.UINT32)),
               ('array ["a"]', (["a"], T.ARRAY, T.STRING)), ("array of 1e5 int32", ([7] * 10**5, T.ARRAY, T.INT32))]
    if vtype == T.ARRAY and isinstance(value, list) and value:
        cut = rng.randrange(len(value))
        choices += [(f"array cut to {cut}", (value[:cut], vtype, sub_type)),
                    ("array doubled", (value + value, vtype, sub_type))]
    return rng.choice(choices)


def _tokenizer_table_edit(rng: random.Random, meta: dict) -> str:
    """A GGUF tokenizer table made inconsistent (in `meta`); what was done."""
    from gguf import GGUFValueType as T

    tokens = list(meta["tokenizer.ggml.tokens"][0])
    op = rng.randrange(7)
    if op == 0 and "tokenizer.ggml.merges" in meta:
        merges = list(meta["tokenizer.ggml.merges"][0])
        bad = rng.choice(["zz qq", "a", "", "a b c", "ab c d", "\u0120\u0120 zz", "a  b", " "])
        merges.insert(rng.randrange(len(merges) + 1), bad)
        meta["tokenizer.ggml.merges"] = (merges, T.ARRAY, T.STRING)
        return f"merge {bad!r} added"
    if op == 1:
        i = rng.randrange(len(tokens))
        tokens[i] = rng.choice(["", tokens[0], tokens[-1], "\ud800".encode("utf-8", "surrogatepass").decode("latin-1"),
                                "x" * 100000])
        meta["tokenizer.ggml.tokens"] = (tokens, T.ARRAY, T.STRING)
        return f"token {i} = {tokens[i][:20]!r}"
    if op == 2:
        key = rng.choice(["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                          "tokenizer.ggml.unknown_token_id",
                          "tokenizer.ggml.padding_token_id"])
        value = rng.choice([len(tokens), 10**9, 2**32 - 1])
        meta[key] = (value, T.UINT32, None)
        return f"{key} = {value}"
    if op == 3:
        key = rng.choice(["tokenizer.ggml.token_type", "tokenizer.ggml.scores"])
        if key not in meta:
            meta[key] = ([0.5] * 3, T.ARRAY, T.FLOAT32)
            return f"{key} of 3 entries"
        values, vtype, sub = meta[key]
        meta[key] = (rng.choice([list(values)[:5], [99] * len(values), [-7] * len(values)]), vtype, sub)
        return f"{key} changed"
    if op == 4:
        model = rng.choice(["gpt2", "llama", "bert", "t5", "rwkv", "none", "", "x" * 1000])
        meta["tokenizer.ggml.model"] = (model, T.STRING, None)
        return f"tokenizer.ggml.model = {model[:20]!r}"
    if op == 5:
        meta["tokenizer.ggml.tokens"] = (tokens[: rng.choice([0, 1, 10, len(tokens) - 1])], T.ARRAY, T.STRING)
        return f"token list cut to {len(meta['tokenizer.ggml.tokens'][0])}"
    meta["tokenizer.ggml.pre"] = (rng.choice(["llama-bpe", "qwen2", "nope", ""]), T.STRING, None)
    return f"tokenizer.ggml.pre = {meta['tokenizer.ggml.pre'][0]!r}"


def _tensor_edit(rng: random.Random, tensors: dict) -> str:
    """One GGUF tensor missing, extra, reshaped or of another dtype (in `tensors`); what was done."""
    name = rng.choice(sorted(tensors))
    op = rng.randrange(5)
    if op == 0:
        del tensors[name]
        return f"tensor {name} missing"
    if op == 1:
        tensors[rng.choice(["blk.9.attn_q.weight", "blk.0.attn_q.bias", "rope_freqs.weight", "junk"])] = \
            np.ones(64, np.float32)
        return "extra tensor"
    x = tensors[name]
    if x.dtype == np.uint8:
        tensors[name] = np.ones((3, 5), np.float32)
        return f"{name} shape (3, 5)"
    if op == 2:
        tensors[name] = np.ascontiguousarray(x.T) if x.ndim == 2 else np.concatenate([x, x])
        return f"{name} transposed / doubled"
    if op == 3:
        tensors[name] = x.astype(rng.choice([np.float64, np.int8, np.int32, np.int16]))
        return f"{name} as {tensors[name].dtype}"
    tensors[name] = np.full(x.shape, rng.choice([np.nan, np.inf]), x.dtype)
    return f"{name} all non-finite"


def _gguf_rewritten(rng: random.Random, tokenizer: str, path: Path) -> str:
    """Write a GGUF with one hostile metadata value, tokenizer table or tensor to `path`; what."""
    import fuzz_base

    meta = fuzz_base.gguf_metadata(tokenizer)
    tensors = fuzz_base.gguf_tensors(len(meta["tokenizer.ggml.tokens"][0]))
    op = rng.randrange(4)
    arch = "llama"
    if op == 0:
        key = rng.choice([*sorted(meta), "llama.rope.scaling.type", "llama.rope.scaling.factor",
                          "llama.attention.key_length", "llama.expert_count", "general.alignment", "general.name",
                          "llama.rope.scaling.original_context_length", "tokenizer.ggml.add_bos_token"])
        old = meta.get(key, (1, None, None))
        what, meta[key] = _hostile_gguf_value(rng, *old)
        what = f"{key} = {what}"
    elif op == 1:
        what = _tokenizer_table_edit(rng, meta)
    elif op == 2:
        what = _tensor_edit(rng, tensors)
    else:
        arch = rng.choice(["qwen2", "gpt2", "falcon", "phi3", "mamba", "", "x" * 300, "llama\u0000"])
        meta = {k.replace("llama.", f"{arch}."): v for k, v in meta.items()}
        what = f"architecture {arch[:20]!r}"
    try:
        fuzz_base.write_gguf(path, tokenizer, meta, tensors, arch=arch)
    except (ValueError, TypeError, OverflowError, struct.error) as err:  # gguf's writer refuses the value
        path.write_bytes(b"")
        return f"{what} (gguf refused it: {type(err).__name__}; empty file)"
    return what


def gguf_case(rng: random.Random, base: Base) -> Case:
    """A GGUF (SentencePiece or BPE tokenizer) damaged or written with one hostile value, converted."""
    import tempfile

    name = rng.choice(["model.gguf", "bpe.gguf"])
    data = base.read(name)
    op = rng.randrange(3)
    if op == 0:
        what, new = damage_bytes(rng, data)
    elif op == 1:
        what, new = _gguf_in_place(rng, data, _gguf_layout(str(base.root / name)))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / name
            what = _gguf_rewritten(rng, "llama" if name == "model.gguf" else "gpt2", out)
            new = out.read_bytes()
    command = "convert_gguf" if name == "model.gguf" else "convert_bpe"
    return new_case(f"{name}: {what}", command, {name: new})


# --- .flm -----------------------------------------------------------------------------------------
def _i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _string(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return _i32(len(data)) + data


def flm_split(data: bytes) -> tuple[dict[str, str], int]:
    """A .flm's model info and the byte offset where the vocab starts."""
    pos, info = 8, {}
    for _ in range(struct.unpack("<i", data[4:8])[0]):
        parts = []
        for _ in range(2):
            n = struct.unpack("<i", data[pos : pos + 4])[0]
            parts.append(data[pos + 4 : pos + 4 + n].decode())
            pos += 4 + n
        info[parts[0]] = parts[1]
    return info, pos


FLM_TEXTS = ["{[1]: 2}", "[" * 150 + "]" * 150, "(" * 500, "1e308", "-1", "0", "True", "None", "''", "'x'", "[1, 2]",
             "{'type': 1}", "{'factor': -1}", "x" * 100000, "\ud800", "nan", "inf", "9" * 5000, "-" * 10, "[]", "{}",
             "{1: 2}", "b'x'", "1j", "(1,)", "{'a'}", "[None]", "'\\x00'", '"quoted"', "", "0x10", "1_000"]
FLM_KEYS = ["model_type", "architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling.type",
            "rope_scaling.factor", "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "torch_dtype",
            "peft_size", "tokenizer_use_score", "tokenizer_has_special_tokens", "bestiary.activation_quant",
            "pre_prompt", "user_role", "bot_role", "history_sep", "chat_template", "bos_token_id", "eos_token_id",
            "head_dim", "sliding_window", "quantization_config", "bestiary.dtype"]


def _flm_info_edit(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    info, end = flm_split(data)
    op = rng.randrange(4)
    if op == 0 and info:
        key = rng.choice(sorted(info))
        del info[key]
        what = f"info {key!r} removed"
    elif op == 1:
        key = rng.choice(["", "\ud800", "x" * 10000, "rope_scaling.", ".", "rope_scaling.type.x"])
        info[key] = rng.choice(FLM_TEXTS)
        what = f"info key {key[:20]!r} = {info[key][:20]!r}"
    else:
        key = rng.choice([*FLM_KEYS, *sorted(info)])
        info[key] = rng.choice(FLM_TEXTS)
        what = f"info {key!r} = {info[key][:30]!r}"
    header = _i32(2, len(info)) + b"".join(_string(k) + _string(v) for k, v in info.items())
    return what, header + data[end:]


def _flm_count_edit(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """The info count, the vocab count or the first token's length or id made wrong."""
    _, end = flm_split(data)
    where = rng.choice([(4, "info count"), (end, "vocab count"), (end + 4, "first token length"),
                        (end + 8, "first token byte")])
    value = rng.choice([-1, 0, 1, 2**31 - 1, -(2**31), 256, 10**9])
    return f"{where[1]} = {value}", _put(data, where[0], _i32(value))


def flm_case(rng: random.Random, base: Base) -> Case:
    """The .flm written by `bestiary export`, damaged or with a hostile model-info value, converted."""
    data = base.read("model.flm")
    op = rng.randrange(4)
    if op == 0:
        what, new = damage_bytes(rng, data)
    elif op == 1:
        what, new = _flm_count_edit(rng, data)
    else:
        what, new = _flm_info_edit(rng, data)
    return new_case(f"model.flm: {what}", rng.choice(["convert_flm", "convert_flm", "convert_flm_dry"]),
                    {"model.flm": new})
