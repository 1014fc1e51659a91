"""config.json and tokenizer files whose JSON parses but whose shape is wrong: one line, exit 2.

The fuzzer's cases of issue 46 (tests/fuzz): an engine's pretrained_config / build_config that is not
an object, mapping sizes that are not integers, an architecture that is a list, JSON nested 100,000
deep, a lone surrogate in a special token, tokenizer ids past the model's vocab_size. Each used to end
as "internal error" (AttributeError, ZeroDivisionError, TypeError, RecursionError, UnicodeEncodeError,
IndexError).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_engine(tmp_path_factory.mktemp("shapes"), tokenizer=True)


def edited(tiny: Path, tmp_path: Path, part: str, name: str, edit) -> Path:
    """A copy of tiny/`part` whose JSON file `name` is `edit(data)` (or the text `edit` returns)."""
    directory = tmp_path / part
    shutil.copytree(tiny / part, directory)
    data = json.loads((directory / name).read_text())
    new = edit(data)
    (directory / name).write_text(new if isinstance(new, str) else json.dumps(new))
    return directory


def set_path(data: dict, dotted: str, value: object) -> dict:
    """`data` with the value at 'a.b.c' replaced."""
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = value
    return data


def commands(engine: Path, tmp_path: Path) -> list[list[str]]:
    """Every command that reads an engine's config.json."""
    text = tmp_path / "text.txt"
    text.write_text("a b c a b c")
    return [["run", "--engine_dir", str(engine), "--input_ids", "1,2,3", "--max_output_len", "2"],
            ["eval", "--engine_dir", str(engine), "--text_file", str(text)],
            ["inspect", str(engine)]]


@pytest.mark.parametrize("field,value,words", [
    ("pretrained_config", 0.5, ["field 'pretrained_config'", "expected a JSON object", "float"]),
    ("pretrained_config", "12", ["field 'pretrained_config'", "expected a JSON object", "str"]),
    ("build_config", float("nan"), ["field 'build_config'", "expected a JSON object"]),
    ("build_config", [1], ["field 'build_config'", "expected a JSON object", "list"]),
])
def test_engine_sections_that_are_not_objects(tiny, tmp_path, capsys, field, value, words):
    engine = edited(tiny, tmp_path, "engine", "config.json", lambda d: set_path(d, field, value))
    for argv in commands(engine, tmp_path):
        one_line(capsys, argv, 2, str(engine / "config.json"), *words)


@pytest.mark.parametrize("field,value", [("tp_size", 0.5), ("tp_size", [1]), ("pp_size", [1]), ("pp_size", "2"),
                                         ("tp_size", True), ("tp_size", 2.0), ("world_size", 0)])
def test_mapping_sizes_are_strict_integers(tiny, tmp_path, capsys, field, value):
    engine = edited(tiny, tmp_path, "engine", "config.json",
                    lambda d: set_path(d, f"pretrained_config.mapping.{field}", value))
    for argv in commands(engine, tmp_path)[:2]:  # inspect shows the file as it is
        one_line(capsys, argv, 2, str(engine / "config.json"), f"field 'pretrained_config.mapping.{field}'")


@pytest.mark.parametrize("value", [[1], {"type": 1}, ["LlamaForCausalLM"]])
def test_architecture_that_is_not_a_name(tiny, tmp_path, capsys, value):
    ckpt = edited(tiny, tmp_path, "ckpt", "config.json", lambda d: set_path(d, "architecture", value))
    words = [str(ckpt / "config.json"), "field 'architecture'", "expected the name of a registered architecture"]
    one_line(capsys, ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "out")], 2, *words)
    one_line(capsys, ["export", "--checkpoint_dir", str(ckpt), "--output_file", str(tmp_path / "m.flm")], 2, *words)
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.flm").exists()


@pytest.mark.parametrize("part,name,argv", [
    ("engine", "config.json", ["run", "--engine_dir", "{d}", "--input_ids", "1,2"]),
    ("ckpt", "config.json", ["build", "--checkpoint_dir", "{d}", "--output_dir", "{t}/out"]),
    ("engine", "tokenizer_config.json", ["run", "--engine_dir", "{d}", "--input_text", "a b"]),
    ("hf", "tokenizer_config.json", ["convert", "--model_dir", "{d}", "--output_dir", "{t}/out"]),
    ("hf", "config.json", ["convert", "--model_dir", "{d}", "--output_dir", "{t}/out"]),
])
def test_json_nested_too_deeply(tiny, tmp_path, capsys, part, name, argv):
    directory = edited(tiny, tmp_path, part, name, lambda d: DEEP)
    argv = [a.format(d=directory, t=tmp_path) for a in argv]
    one_line(capsys, argv, 2, str(directory / name), "not valid JSON", "nested too deeply")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["bos_token", "pad_token"])
def test_lone_surrogate_in_a_special_token(tiny, tmp_path, capsys, key):
    hf = edited(tiny, tmp_path, "hf", "tokenizer_config.json", lambda d: set_path(d, key, "\ud800"))
    engine = edited(tiny, tmp_path, "engine", "tokenizer_config.json", lambda d: set_path(d, key, "\ud800"))
    words = [f"field '{key}'", "lone surrogate"]
    one_line(capsys, ["convert", "--model_dir", str(hf), "--output_dir", str(tmp_path / "out")], 2,
             str(hf / "tokenizer_config.json"), *words)
    assert not (tmp_path / "out").exists()
    one_line(capsys, ["run", "--engine_dir", str(engine), "--input_text", "a b"], 2,
             str(engine / "tokenizer_config.json"), *words)


def _scaled_vocab(data: dict, keep: tuple[str, ...]) -> dict:
    """tokenizer.json with every vocab id but `keep`'s times 1000: ids past the tiny model's 96."""
    vocab = data["model"]["vocab"]
    data["model"]["vocab"] = {t: i if t in keep else i * 1000 for t, i in vocab.items()}
    return data


def _eval(engine: Path, tmp_path: Path) -> list[str]:
    text = tmp_path / "text.txt"
    text.write_text("a b c a b c")
    return ["eval", "--engine_dir", str(engine), "--text_file", str(text)]


def test_special_token_ids_past_vocab_size_refused_at_load(tiny, tmp_path, capsys):
    engine = edited(tiny, tmp_path, "engine", "tokenizer.json", lambda d: _scaled_vocab(d, ("<unk>",)))
    words = [str(engine / "tokenizer.json"), "bos_token '<s>' has id 1000", "outside the model's vocabulary [0, 96)"]
    one_line(capsys, _eval(engine, tmp_path), 2, *words)
    one_line(capsys, ["run", "--engine_dir", str(engine), "--input_ids", "1,2"], 2, *words)
    hf = edited(tiny, tmp_path, "hf", "tokenizer.json", lambda d: _scaled_vocab(d, ("<unk>",)))
    one_line(capsys, ["convert", "--model_dir", str(hf), "--output_dir", str(tmp_path / "out")], 2,
             str(hf / "tokenizer.json"), "bos_token '<s>' has id 1000", str(hf / "config.json"))
    assert not (tmp_path / "out").exists()  # convert does not write what run would refuse


def test_a_spare_added_token_past_vocab_size_loads_and_is_refused_in_a_prompt(tiny, tmp_path, capsys):
    """As in transformers, a tokenizer may hold added tokens past the embedding (spare ones): the engine
    loads; text that holds one is refused with one line before the embedding lookup."""
    def add(data: dict) -> dict:
        data["added_tokens"] = [{"id": 10**6, "content": "<x>", "special": True, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False}]
        return data

    engine = edited(tiny, tmp_path, "engine", "tokenizer.json", add)  # `tokenizers` numbers it 96, after the vocab
    from bestiary.core.cli.main import main

    assert main(_eval(engine, tmp_path)) == 0
    capsys.readouterr()
    (tmp_path / "text.txt").write_text("a b <x> c")
    one_line(capsys, ["eval", "--engine_dir", str(engine), "--text_file", str(tmp_path / "text.txt")], 2,
             "96", "outside the model's vocabulary [0, 96)")


def test_text_ids_past_vocab_size_refused_before_the_embedding(tiny, tmp_path, capsys):
    engine = edited(tiny, tmp_path, "engine", "tokenizer.json",
                    lambda d: _scaled_vocab(d, ("<unk>", "<s>", "</s>")))
    one_line(capsys, _eval(engine, tmp_path), 2, str(engine / "tokenizer.json"), "token id",
             "outside the model's vocabulary [0, 96)")
    one_line(capsys, ["run", "--engine_dir", str(engine), "--input_text", "a b"], 2, "outside the vocabulary [0, 96)")


def test_a_rank_tensor_of_the_wrong_kind_is_refused_at_load(tiny, tmp_path, capsys):
    """An int32 lm_head (fuzz seed 1046 case 89) failed in the first matmul as an internal error."""
    from safetensors.torch import load_file, save_file

    engine = tmp_path / "engine"
    shutil.copytree(tiny / "engine", engine)
    weights = load_file(str(engine / "rank0.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"].to(torch.int32)
    save_file(weights, str(engine / "rank0.safetensors"))
    one_line(capsys, ["run", "--engine_dir", str(engine), "--input_ids", "1,2"], 2,
             "rank0.safetensors", "tensor 'lm_head.weight' is int32, expected float32")
