"""Fuzz: corrupted safetensors, GGUF, config.json, engine config and tokenizer files through the CLI.

Every case (fixed seed) is corrupted so that it can never be a valid input (a byte JSON never
allows, a size that no longer matches, a shape the weights do not have, a NaN, ...), fed to
`bestiary.core.cli.main.main` in-process (and a sample of them as real subprocesses), and must
end with exit code 2 (bad input) or 1 (machine fault, not an internal error), at most 3 lines
on stderr, no traceback, no new directory, and every existing file byte-identical (the earlier
checkpoint a convert would replace included).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402

SEED = 15
COUNTS = {"safetensors": 60, "gguf": 48, "config": 44, "engine_config": 44, "tokenizer": 44}  # 240 in all
SUBPROCESS_EVERY = 24  # every 24th case also runs as a real process: 10 of them
BAD_JSON_BYTES = [*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x80, 0xC2), *range(0xF5, 0x100)]


@dataclass
class Case:
    """One corrupted input: which file gets which bytes, and the command that reads it."""

    kind: str
    what: str
    file: str  # relative to the work dir
    data: bytes
    argv: list[str]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


# --- safetensors -------------------------------------------------------------------------------
def _st_parts(data: bytes) -> tuple[int, dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def _st_join(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + body


def safetensors_cases(rng: random.Random, data: bytes, n: int) -> list[tuple[str, bytes]]:
    hlen, header, body = _st_parts(data)
    names = sorted(k for k in header if k != "__metadata__")
    out = []
    for i in range(n):
        op = i % 9
        name = rng.choice(names)
        entry = dict(header[name])
        h = {k: dict(v) if isinstance(v, dict) else v for k, v in header.items()}
        if op == 0:
            cut = rng.randrange(0, len(data))
            out.append((f"truncated at {cut}", data[:cut]))
        elif op == 1:
            pos = rng.randrange(8, 8 + hlen)
            out.append((f"header byte {pos} not JSON", data[:pos] + bytes([rng.choice(BAD_JSON_BYTES)]) + data[pos + 1 :]))
        elif op == 2:
            wrong = rng.choice([0, 1, hlen - 1, hlen + 1, rng.randrange(2**20, 2**40), 2**64 - 1])
            out.append((f"header length {wrong}", struct.pack("<Q", wrong) + data[8:]))
        elif op == 3:
            entry["dtype"] = rng.choice(["F16", "BF16", "I8", "U8", "F64", "I64", "BOOL", "XX"])
            h[name] = entry
            out.append((f"{name} dtype {entry['dtype']}", _st_join(h, body)))
        elif op == 4:
            shape = list(entry["shape"])
            d = rng.randrange(len(shape))
            shape[d] = rng.choice([shape[d] + 1, shape[d] * 2, 0, -1])
            entry["shape"] = shape
            h[name] = entry
            out.append((f"{name} shape {shape}", _st_join(h, body)))
        elif op == 5:
            start, end = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[start + 8, end + 8], [start, end + len(body)], [end, start]])
            h[name] = entry
            out.append((f"{name} offsets {entry['data_offsets']}", _st_join(h, body)))
        elif op == 6:
            h[name + rng.choice(["_x", ".extra", "s"])] = h.pop(name)
            out.append((f"{name} renamed", _st_join(h, body)))
        elif op == 7:
            start, end = entry["data_offsets"]
            value = rng.choice([float("nan"), float("inf"), float("-inf")])
            k = start + 4 * rng.randrange((end - start) // 4)
            out.append((f"{name} holds {value}", data[: 8 + hlen + k] + struct.pack("<f", value) + data[8 + hlen + k + 4 :]))
        else:
            junk = rng.randbytes(rng.randrange(0, 4096))
            out.append((f"{len(junk)} random bytes", junk))
    return out


# --- GGUF --------------------------------------------------------------------------------------
def _gguf_layout(path: Path) -> dict:
    """Offsets of the header counts, some config values and each tensor's info (from gguf's reader)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    values = {}
    for key in ("llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.head_count_kv"):
        field = reader.fields[key]
        part = field.parts[field.data[0]]
        values[key] = (field.offset + sum(p.nbytes for p in field.parts[: field.data[0]]), int(part[0]), part.nbytes)
    arch = reader.fields["general.architecture"]
    arch_pos = arch.offset + sum(p.nbytes for p in arch.parts[: arch.data[0]])
    tensors = []
    for t in reader.tensors:
        parts = t.field.parts  # name_len, name, n_dims, dims, type, offset
        type_pos = t.field.offset + sum(p.nbytes for p in parts[:4])
        dims_pos = t.field.offset + sum(p.nbytes for p in parts[:3])
        tensors.append({"name": t.name, "type_pos": type_pos, "dims_pos": dims_pos, "dims": [int(d) for d in parts[3]],
                        "offset_pos": type_pos + 4, "data": (int(t.data_offset), int(t.n_bytes)),  # absolute
                        "f32": int(t.tensor_type) == 0})
    data_end = max(t["data"][0] + t["data"][1] for t in tensors)
    return {"values": values, "arch_pos": arch_pos, "tensors": tensors, "data_end": data_end,
            "kv_count": len(reader.fields), "tensor_count": len(reader.tensors)}


def _put(data: bytes, pos: int, blob: bytes) -> bytes:
    return data[:pos] + blob + data[pos + len(blob) :]


def gguf_cases(rng: random.Random, data: bytes, layout: dict, n: int) -> list[tuple[str, bytes]]:
    out = []
    tensor_count = struct.unpack("<Q", data[8:16])[0]
    kv_count = struct.unpack("<Q", data[16:24])[0]
    for i in range(n):
        op = i % 11
        t = rng.choice(layout["tensors"])
        if op == 0:
            cut = rng.randrange(0, layout["data_end"])
            out.append((f"truncated at {cut}", data[:cut]))
        elif op == 1:
            magic = rng.choice([b"GGUE", b"FUGG", b"ggml", rng.randbytes(4)])
            out.append((f"magic {magic!r}", _put(data, 0, magic if magic != b"GGUF" else b"GGUG")))
        elif op == 2:
            version = rng.choice([0, 1, 4, 99, 2**32 - 1])
            out.append((f"version {version}", _put(data, 4, struct.pack("<I", version))))
        elif op == 3:
            count = rng.choice([tensor_count + 1, tensor_count + 1000, 2**40, 2**64 - 1, tensor_count - 1, 0])
            out.append((f"tensor count {count}", _put(data, 8, struct.pack("<Q", count))))
        elif op == 4:
            count = rng.choice([kv_count + 1, kv_count - 1, 0, 2**40, 2**64 - 1])
            out.append((f"kv count {count}", _put(data, 16, struct.pack("<Q", count))))
        elif op == 5:
            qtype = rng.choice([4, 5, 42, 200, 2**31, 2**32 - 1])
            out.append((f"{t['name']} type {qtype}", _put(data, t["type_pos"], struct.pack("<I", qtype))))
        elif op == 6:
            d = rng.randrange(len(t["dims"]))
            new = rng.choice([t["dims"][d] * 2, t["dims"][d] + 32, 2**40])
            out.append((f"{t['name']} dim {d} = {new}", _put(data, t["dims_pos"] + 8 * d, struct.pack("<Q", new))))
        elif op == 7:
            off = rng.choice([len(data), 2**40, 2**64 - 32])
            out.append((f"{t['name']} data offset {off}", _put(data, t["offset_pos"], struct.pack("<Q", off))))
        elif op == 8:
            key = rng.choice(sorted(layout["values"]))
            pos, true, size = layout["values"][key]
            new = rng.choice([v for v in (0, 1, true - 1, true + 1, true * 2, 2**31 - 1) if v != true and v >= 0])
            out.append((f"{key} = {new}", _put(data, pos, new.to_bytes(size, "little"))))
        elif op == 9:
            f32 = [x for x in layout["tensors"] if x["f32"]]
            t = rng.choice(f32)
            start, nbytes = t["data"]
            k = start + 4 * rng.randrange(nbytes // 4)
            value = rng.choice([float("nan"), float("inf")])
            out.append((f"{t['name']} holds {value}", _put(data, k, struct.pack("<f", value))))
        else:
            name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)).encode()
            out.append((f"architecture {name!r}", _put(data, layout["arch_pos"], name if name != b"llama" else b"lama_")))
    return out


# --- JSON configs ------------------------------------------------------------------------------
def json_text_cases(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    """A corruption of a JSON object's text that no JSON reader accepts as an object."""
    op = rng.randrange(4)
    if op == 0:
        cut = rng.randrange(0, len(text.rstrip()) - 1)
        return f"truncated at {cut}", text[:cut]
    if op == 1:
        pos = rng.randrange(len(text))
        return f"byte {pos} not JSON", text[:pos] + bytes([rng.choice(BAD_JSON_BYTES)]) + text[pos + 1 :]
    if op == 2:
        other = rng.choice(["[]", f"[1, {rng.randrange(1000)}]", str(rng.randrange(10**6)), f'"t{rng.randrange(99)}"',
                            "null", "true"])
        return f"top level {other}", other.encode()
    return "random bytes", rng.randbytes(rng.randrange(1, 300))


BAD_VALUES = ["many", -1, 0, 1.5, [1], {"a": 1}, None, 10**12]
HF_SHAPE_KEYS = ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                 "num_key_value_heads"]


def hf_config_cases(rng: random.Random, text: bytes, n: int) -> list[tuple[str, bytes]]:
    config = json.loads(text)
    out = []
    for i in range(n):
        c = dict(config)
        if i % 3 == 0:
            out.append(json_text_cases(rng, text))
            continue
        key = rng.choice(HF_SHAPE_KEYS)
        if i % 3 == 1:
            value = rng.choice([v for v in BAD_VALUES if v != c[key] and not (key == "num_key_value_heads" and v is None)])
            c[key] = value
            what = f"{key} = {value!r}"
        elif rng.random() < 0.2:
            c["architectures"], c["model_type"] = [rng.choice(["MambaForCausalLM", "X", ""])], "mamba"
            what = "unknown architecture"
        else:
            del c[key]
            what = f"{key} deleted"
        out.append((what, json.dumps(c).encode()))
    return out


ENGINE_BUILD_BAD = {"max_batch_size": [0, -1, "x", 1.5], "max_seq_len": [0, 4096, "x"],
                    "max_input_len": [96, 1000, 0], "tokens_per_block": [0, -4, "x"],
                    "max_tokens_in_paged_kv_cache": [10**13, 0], "max_num_tokens": [0, "x"], "bogus_field": [1]}


def engine_config_cases(rng: random.Random, text: bytes, n: int) -> list[tuple[str, bytes]]:
    config = json.loads(text)
    out = []
    for i in range(n):
        c = json.loads(text)
        op = i % 5
        if op == 0:
            out.append(json_text_cases(rng, text))
            continue
        if op == 1:
            c["format_version"] = rng.choice([0, 2, "1", None, 1.5])
            what = f"format_version {c['format_version']!r}"
        elif op == 2:
            key = rng.choice([k for k in HF_SHAPE_KEYS if k in config["pretrained_config"]])
            value = rng.choice([v for v in BAD_VALUES if v != config["pretrained_config"][key]])
            c["pretrained_config"][key] = value
            what = f"pretrained_config.{key} = {value!r}"
        elif op == 3:
            key = rng.choice(sorted(ENGINE_BUILD_BAD))
            c["build_config"][key] = rng.choice(ENGINE_BUILD_BAD[key])
            what = f"build_config.{key} = {c['build_config'][key]!r}"
        else:
            victim = rng.choice(["pretrained_config", "format_version", "architecture"])
            if victim == "architecture":
                c["pretrained_config"]["architecture"] = rng.choice(["NopeForCausalLM", 7, ""])
            else:
                del c[victim]
            what = f"{victim} broken"
        out.append((what, json.dumps(c).encode()))
    return out


def tokenizer_cases(rng: random.Random, tok: bytes, tok_config: bytes, n: int,
                    chat: bool) -> list[tuple[str, str, bytes]]:
    """(file name, what, bytes) of a tokenizer.json / tokenizer_config.json that cannot load; with
    `chat` (the command renders the template), a template that raises when rendered too."""
    tokenizer = json.loads(tok)
    out = []
    for i in range(n):
        op = i % 4
        if op == 0:
            what, data = json_text_cases(rng, tok)
            out.append(("tokenizer.json", what, data))
        elif op == 1:
            t = json.loads(tok)
            choice = rng.randrange(4)
            if choice == 0:
                del t["model"]
            elif choice == 1:
                t["model"] = {"type": "Nope"}
            elif choice == 2:
                t["model"]["vocab"] = ["a", "b"]
            else:
                t["pre_tokenizer"] = {"type": "NoSuchPreTokenizer"}
            out.append(("tokenizer.json", f"structure {choice}", json.dumps(t).encode()))
        elif op == 2:
            what, data = json_text_cases(rng, tok_config)
            out.append(("tokenizer_config.json", what, data))
        else:
            c = json.loads(tok_config)
            key = rng.choice(["bos_token", "eos_token", "pad_token", "chat_template", "chat_template"])
            if key == "chat_template":
                templates = ["{% for m in messages %}{{ m['content'] }", "{{ x | nofilter }}", "{% if %}",
                             *(["{{ raise_exception('bad') }}", "{{ messages[5]['content'] }}"] if chat else [])]
                c[key] = rng.choice([5, [1], {"a": 1}, *templates])
            else:
                c[key] = rng.choice([5, [1], {"content": 5}, True])
            out.append(("tokenizer_config.json", f"{key} = {c[key]!r}", json.dumps(c).encode()))
    assert tokenizer
    return out


# --- the run -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from test_gguf_source import write_tiny_llama

    base = make_tiny_engine(tmp_path_factory.mktemp("fuzz"), tokenizer=True, ckpt="existing")
    write_tiny_llama(base / "model.gguf")
    assert main(["convert", "--model_dir", str(base / "model.gguf"), "--output_dir", str(base / "scratch")]) == 0
    shutil.rmtree(base / "scratch")
    return base


def make_cases(work: Path) -> list[Case]:
    rng = random.Random(SEED)

    def read(rel: str) -> bytes:
        return (work / rel).read_bytes()

    convert = ["convert", "--model_dir", str(work / "hf"), "--output_dir", str(work / "existing")]
    run_ids = ["run", "--engine_dir", str(work / "engine"), "--input_ids", "1,2", "--max_output_len", "2"]
    run_text = ["run", "--engine_dir", str(work / "engine"), "--input_text", "a b", "--max_output_len", "2", "--chat"]
    cases = [Case("safetensors", w, "hf/model.safetensors", d, convert)
             for w, d in safetensors_cases(rng, read("hf/model.safetensors"), COUNTS["safetensors"] - 8)]
    cases += [Case("safetensors", "engine " + w, "engine/rank0.safetensors", d, run_ids)
              for w, d in safetensors_cases(rng, read("engine/rank0.safetensors"), 8)]
    layout = _gguf_layout(work / "model.gguf")
    gguf_convert = ["convert", "--model_dir", str(work / "model.gguf"), "--output_dir", str(work / "existing")]
    cases += [Case("gguf", w, "model.gguf", d, gguf_convert)
              for w, d in gguf_cases(rng, read("model.gguf"), layout, COUNTS["gguf"])]
    cases += [Case("config", w, "hf/config.json", d, convert)
              for w, d in hf_config_cases(rng, read("hf/config.json"), COUNTS["config"])]
    cases += [Case("engine_config", w, "engine/config.json", d, run_ids)
              for w, d in engine_config_cases(rng, read("engine/config.json"), COUNTS["engine_config"])]
    half = COUNTS["tokenizer"] // 2
    cases += [Case("tokenizer", f"{name}: {w}", f"hf/{name}", d, convert)
              for name, w, d in tokenizer_cases(rng, read("hf/tokenizer.json"), read("hf/tokenizer_config.json"), half,
                                                chat=False)]
    cases += [Case("tokenizer", f"engine {name}: {w}", f"engine/{name}", d, run_text)
              for name, w, d in tokenizer_cases(rng, read("engine/tokenizer.json"),
                                                read("engine/tokenizer_config.json"), half, chat=True)]
    return cases


def check(case: Case, code: int, err: str, before: dict, after: dict) -> None:
    label = f"[{case.kind}] {case.what}: exit {code}: {err!r}"
    assert code in (1, 2), label
    assert "Traceback" not in err and "internal error" not in err, label
    assert len(err.strip().splitlines()) <= 3, label
    assert after == before, label  # no new directory, the existing output byte-identical


def test_fuzz_corrupted_inputs_in_process_and_as_processes(work, capsys):
    cases = make_cases(work)
    distinct = {(c.file, c.data) for c in cases}
    assert len(cases) == 240 and len(distinct) >= 200, len(distinct)  # some corruptions repeat (few choices)
    assert {c.kind for c in cases} == set(COUNTS)
    failures = []
    for i, case in enumerate(cases):
        target = work / case.file
        pristine = target.read_bytes()
        target.write_bytes(case.data)
        try:
            before = snapshot(work)
            capsys.readouterr()
            code = main(case.argv)
            err = capsys.readouterr().err
            try:
                check(case, code, err, before, snapshot(work))
            except AssertionError as e:
                failures.append(str(e).splitlines()[0])
            if i % SUBPROCESS_EVERY == SUBPROCESS_EVERY - 1:
                proc = subprocess.run([sys.executable, "-m", "bestiary", *case.argv], capture_output=True,
                                      text=True, check=False)
                try:
                    check(case, proc.returncode, proc.stderr, before, snapshot(work))
                except AssertionError as e:
                    failures.append("subprocess " + str(e).splitlines()[0])
        finally:
            target.write_bytes(pristine)
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:40])
