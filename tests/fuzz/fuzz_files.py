"""Fuzz cases of the text and safetensors inputs: .safetensors (HF model, checkpoint, engine), every
config.json (HF, generation, checkpoint, engine) and the tokenizer files (tokenizer.json,
tokenizer_config.json), each through the commands that read it."""

from __future__ import annotations

import json
import random
import struct

from fuzz_cases import Base, Case, new_case
from fuzz_mutations import damage_bytes, damage_json_text, dumps, edit_tree, hostile_value, nested, set_key

# Which commands read which file (a case picks one).
READERS = {
    "hf": ["convert_hf", "convert_hf", "convert_hf_dry", "convert_hf_int8", "run_hf"],
    "ckpt": ["build", "build", "export", "inspect_ckpt"],
    "engine": ["run_ids", "run_text", "eval", "inspect_engine", "chat", "serve", "export_engine"],
}
SAFETENSORS = {"hf": "hf/model.safetensors", "ckpt": "ckpt/rank0.safetensors", "engine": "engine/rank0.safetensors"}
ST_DTYPES = ["F16", "BF16", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "XX", "", "f32"]


def _st_split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _st_join(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + body


def _st_tensor_edit(rng: random.Random, header: dict, body: bytes) -> tuple[str, dict, bytes]:
    """One tensor of the header made wrong: dtype, shape, offsets, renamed, dropped, duplicated, extra."""
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    entry = header[name]
    op = rng.randrange(8)
    if op == 0:
        entry["dtype"] = rng.choice(ST_DTYPES)
        return f"{name} dtype {entry['dtype']!r}", header, body
    if op == 1:
        shape = list(entry["shape"])
        d = rng.randrange(len(shape))
        shape[d] = rng.choice([0, 1, shape[d] + 1, shape[d] * 2, 2**31, 2**62])
        entry["shape"] = rng.choice([shape, shape[::-1], [*shape, 1], shape[:-1], []])
        return f"{name} shape {entry['shape']}", header, body
    if op == 2:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[start + 2, end + 2], [start, end + len(body)], [end, start], [-8, end],
                                            [start, 2**64 - 1], [0, 0]])
        return f"{name} offsets {entry['data_offsets']}", header, body
    if op == 3:
        header[name + rng.choice(["_x", ".extra", "s", "\u00e9"])] = header.pop(name)
        return f"{name} renamed (missing, and an unknown one)", header, body
    if op == 4:
        del header[name]
        return f"{name} missing", header, body
    if op == 5:
        extra = name.replace("layers.0", "layers.7").replace("layers.1", "layers.9")
        header[extra if extra != name else name + ".bias"] = dict(entry)
        return f"extra tensor beside {name}", header, body
    if op == 6:
        header["__metadata__"] = rng.choice([{"format": "tf"}, {"format": 1}, [1], "x", {"a": {"b": 1}}, None])
        return f"__metadata__ {header['__metadata__']!r}", header, body
    what, tree = edit_tree(rng, header)
    return f"header {what}", tree, body


def _st_nonfinite(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """A NaN or inf written into one float32 tensor's values."""
    header, body = _st_split(data)
    name = rng.choice(sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"))
    start, end = header[name]["data_offsets"]
    value = rng.choice([float("nan"), float("inf"), float("-inf"), 3e38])
    k = 8 + (len(data) - 8 - len(body)) + start + 4 * rng.randrange((end - start) // 4)
    return f"{name} holds {value}", data[:k] + struct.pack("<f", value) + data[k + 4 :]


def safetensors_case(rng: random.Random, base: Base) -> Case:
    """A .safetensors file damaged (bytes, header length, a tensor's entry, values) and read by a command."""
    part = rng.choice(list(SAFETENSORS))
    rel, data = SAFETENSORS[part], base.read(SAFETENSORS[part])
    op = rng.randrange(5)
    if op == 0:
        what, new = damage_bytes(rng, data)
    elif op == 1:
        wrong = rng.choice([0, 1, 7, 2**20, 2**40, 2**63, 2**64 - 1, struct.unpack("<Q", data[:8])[0] + 1])
        what, new = f"header length {wrong}", struct.pack("<Q", wrong) + data[8:]
    elif op == 2:
        what, new = _st_nonfinite(rng, data)
    else:
        header, body = _st_split(data)
        what, header, body = _st_tensor_edit(rng, header, body)
        new = _st_join(header, body) if isinstance(header, dict) else struct.pack("<Q", 4) + b"null" + body
    return new_case(f"{rel}: {what}", rng.choice(READERS[part]), {rel: new})


# --- config.json ---------------------------------------------------------------------------------
ARCHITECTURES = [("ChatGLMModel", "chatglm"), ("Qwen2ForCausalLM", "qwen2"), ("OPTForCausalLM", "opt"),
                 ("FalconForCausalLM", "falcon"), ("MixtralForCausalLM", "mixtral"), ("GPT2LMHeadModel", "gpt2"),
                 ("BloomForCausalLM", "bloom"), ("BaichuanForCausalLM", "baichuan"), ("QWenLMHeadModel", "qwen"),
                 ("Qwen2MoeForCausalLM", "qwen2_moe"), ("Exaone4ForCausalLM", "exaone4"), ("Nope", "nope")]
HF_EXTRA_KEYS = ["rope_scaling", "rope_parameters", "rope_theta", "head_dim", "sliding_window", "partial_rotary_factor",
                 "attention_bias", "mlp_bias", "quantization_config", "torch_dtype", "dtype", "architectures",
                 "model_type", "tie_word_embeddings", "max_position_embeddings", "num_key_value_heads",
                 "layer_types", "use_sliding_window", "max_window_layers", "auto_map", "text_config",
                 "pretraining_tp", "hidden_act", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
                 "num_local_experts", "num_experts_per_tok", "trust_remote_code", "transformers_version"]


def rope_dict(rng: random.Random) -> tuple[str, object]:
    """A rope_scaling / rope_parameters dict with one hostile member."""
    kind = rng.choice(["linear", "dynamic", "yarn", "llama3", "longrope", "default", "su", "nope", 7, None])
    rope = {"rope_type": kind, "type": kind, "factor": 2.0, "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
            "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    for key in rng.sample(sorted(rope), rng.randrange(0, 4)):
        del rope[key]
    key = rng.choice(sorted(rope) or ["factor"])
    what, rope[key] = hostile_value(rng)
    return f"{{rope_type {kind!r}, {key} = {what}}}", rope


def _config_edit(rng: random.Random, config: dict, hf: bool) -> tuple[str, dict]:
    """One key of a config (any depth; for an HF config also keys it may lack, rope dicts and
    other architectures) set to a wrong type, range or size, or deleted."""
    op = rng.randrange(6 if hf else 3)
    if op in (0, 1):
        return edit_tree(rng, config)
    if op == 2:
        return set_key(config, rng.choice(sorted(config)), rng)
    if op == 3:
        return set_key(config, rng.choice(HF_EXTRA_KEYS), rng)
    if op == 4:
        what, rope = rope_dict(rng)
        key = rng.choice(["rope_scaling", "rope_parameters"])
        return f"{key} = {what}", {**config, key: rope}
    arch, model_type = rng.choice(ARCHITECTURES)
    edited = {**config, "architectures": [arch], "model_type": model_type}
    what, edited = set_key(edited, rng.choice([*sorted(config), *HF_EXTRA_KEYS]), rng) if rng.random() < 0.7 \
        else ("as is", edited)
    return f"architectures [{arch}], {what}", edited


def config_case(rng: random.Random, base: Base) -> Case:
    """A config.json (HF, generation, checkpoint or engine) with one wrong key, or not JSON."""
    rel = rng.choice(["hf/config.json", "hf/config.json", "hf/generation_config.json", "ckpt/config.json",
                      "engine/config.json", "engine/config.json"])
    text = base.read(rel)
    part = rel.split("/")[0]
    if rng.random() < 0.2:
        what, new = damage_json_text(rng, text)
    else:
        config = json.loads(text)
        if part == "engine" and rng.random() < 0.5:
            section = rng.choice(["pretrained_config", "build_config"])
            what, config[section] = _config_edit(rng, config[section], hf=False)
            what = f"{section}.{what}"
        else:
            what, config = _config_edit(rng, config, hf=part == "hf" and "generation" not in rel)
        new = dumps(config)
    return new_case(f"{rel}: {what}", rng.choice(READERS[part]), {rel: new})


# --- tokenizer files -----------------------------------------------------------------------------
def _tokenizer_json_edit(rng: random.Random, tok: dict) -> tuple[str, dict]:
    """tokenizer.json made wrong: any key, the vocab's ids, a BPE model with bad merges, added tokens."""
    op = rng.randrange(5)
    vocab = tok["model"]["vocab"]
    if op == 0:
        return edit_tree(rng, tok)
    if op == 1:
        token = rng.choice(sorted(vocab))
        vocab[token] = rng.choice([-1, 10**9, 2**31, 2**63, 95, 96, 0, "1", 1.5, None])
        return f"vocab[{token!r}] = {vocab[token]!r}", tok
    if op == 2:
        merges = rng.choice([["w1 zz"], ["a b", "ab"], [""], [["a", "b"]], [1], ["a b c"], ["q q"]])
        tok["model"] = {"type": "BPE", "vocab": vocab, "merges": merges, "unk_token": "<unk>"}
        return f"BPE model, merges {merges!r}", tok
    if op == 3:
        content = rng.choice(["", "\ud800", "x" * 100000, "<s>", 5, None])
        tok["added_tokens"] = [{"id": rng.choice([0, 96, 10**9, -1, "x"]), "content": content, "special": True,
                                "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}]
        return f"added token {str(content)[:20]!r} {tok['added_tokens'][0]['id']!r}", tok
    tok["model"]["vocab"] = {k: v * 1000 for k, v in vocab.items()}
    return "vocab ids x 1000 (beyond the model's vocab_size)", tok


def _tokenizer_config_edit(rng: random.Random, conf: dict) -> tuple[str, dict]:
    key = rng.choice(["bos_token", "eos_token", "pad_token", "unk_token", "added_tokens_decoder", "model_max_length",
                      "generation_eos_token_id", "chat_template", "tokenizer_class", "add_bos_token",
                      rng.choice(sorted(conf))])
    if key.endswith("_token") and rng.random() < 0.4:
        conf[key] = rng.choice([{"content": 5}, {"content": "</s>", "lstrip": "x"}, "<none-such>", "", "\ud800"])
        return f"{key} = {conf[key]!r}", conf
    if key == "chat_template" and rng.random() < 0.5:
        conf[key] = rng.choice([[{"name": "default", "template": 5}], [], [{"name": 1}], {"default": "x"},
                                [{"name": "tool_use", "template": "{{ x }}"}], nested(200)])
        return f"chat_template = {str(conf[key])[:60]}", conf
    return set_key(conf, key, rng)


def tokenizer_case(rng: random.Random, base: Base) -> Case:
    """tokenizer.json or tokenizer_config.json (HF dir or engine) wrong, read by a command that uses it."""
    part = rng.choice(["hf", "engine", "engine"])
    name = rng.choice(["tokenizer.json", "tokenizer_config.json"])
    rel = f"{part}/{name}"
    text = base.read(rel)
    if rng.random() < 0.25:
        what, new = damage_json_text(rng, text)
    else:
        edit = _tokenizer_json_edit if name == "tokenizer.json" else _tokenizer_config_edit
        what, tree = edit(rng, json.loads(text))
        new = dumps(tree)
    readers = ["convert_hf", "run_hf"] if part == "hf" else ["run_text", "run_chat", "chat", "eval", "serve"]
    command = rng.choice(readers)
    return new_case(f"{rel}: {what}", command, {rel: new})
