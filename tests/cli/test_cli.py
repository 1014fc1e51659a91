"""The `bestiary` CLI: the happy path, and user mistakes (one line, exit 2, nothing left behind)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bestiary.core.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    src = make_tiny_llama(base)
    assert main(["convert", "--model_dir", str(src), "--output_dir", str(base / "ckpt")]) == 0
    assert main(["build", "--checkpoint_dir", str(base / "ckpt"), "--output_dir", str(base / "engine"),
                 "--max_batch_size", "4", "--max_seq_len", "96"]) == 0
    return base


def test_build_writes_engine_config(tiny):
    config = json.loads((tiny / "engine" / "config.json").read_text())
    assert config["format_version"] == 1
    assert config["build_config"]["max_batch_size"] == 4 and config["build_config"]["max_seq_len"] == 96
    assert config["pretrained_config"]["architecture"] == "LlamaForCausalLM"


def test_run_ids_stdout_only(tiny):
    result = run_cli("run", "--engine_dir", str(tiny / "engine"), "--input_ids", "1,2,3", "4,5",
                     "--max_output_len", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 5 for line in lines)
    assert "tokens/s" in result.stderr and "tokens/s" not in result.stdout


def test_run_streaming_equals_batch(tiny):
    batch = run_cli("run", "--engine_dir", str(tiny / "engine"), "--input_ids", "7,8,9", "--max_output_len", "6")
    stream = run_cli("run", "--engine_dir", str(tiny / "engine"), "--input_ids", "7,8,9", "--max_output_len", "6",
                     "--streaming")
    assert stream.returncode == 0, stream.stderr
    assert stream.stdout.split() == batch.stdout.split()


def test_inspect_and_list(tiny):
    result = run_cli("inspect", str(tiny / "engine"))
    assert result.returncode == 0 and "transformer.layers.0.attention.qkv.weight" in result.stdout
    listing = run_cli("list")
    assert listing.returncode == 0 and "LlamaForCausalLM" in listing.stdout


# The zoo's families (issue 25), by the names their plugins register (models/*/__init__.py SPEC.name).
ZOO_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "QWenLMHeadModel",
                     "GPT2LMHeadModel", "BloomForCausalLM", "BaichuanForCausalLM", "Exaone4ForCausalLM")


def test_list_shows_the_zoo(capsys):
    """`bestiary list` has a row for each zoo family, named in its architecture column, from package bestiary."""
    assert main(["list"]) == 0
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("│")]
    packages = {row[0]: row[1] for row in rows if row[0]}
    for name in ZOO_ARCHITECTURES:
        assert packages.get(name) == "bestiary", f"{name} is not listed: {sorted(packages)}"
    claims = {row[0]: row[2] for row in rows if row[0]}
    assert "MistralForCausalLM" in claims["LlamaForCausalLM"]  # an alias: LLaMA's spec claims it


def assert_user_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    err = result.stderr.strip()
    for word in words:
        assert word in err, err


def test_missing_path(tmp_path):
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", "--model_dir", str(tmp_path / "nope"), "--output_dir", str(out)), "nope")
    assert not out.exists()


def test_no_config_json(tmp_path):
    (tmp_path / "src").mkdir()
    out = tmp_path / "out"
    assert_user_error(run_cli("convert", "--model_dir", str(tmp_path / "src"), "--output_dir", str(out)),
                      "config.json")
    assert not out.exists()


def test_unknown_architecture_lists_registered(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny / "hf", src)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (src / "config.json").write_text(json.dumps(config))
    assert_user_error(run_cli("convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out")),
                      "MambaForCausalLM", "LlamaForCausalLM")


def test_truncated_safetensors(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny / "hf", src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_user_error(run_cli("convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out")),
                      "model.safetensors")
    assert not (tmp_path / "out").exists()


def _resave(src, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_names_key(tiny, tmp_path):
    src = _resave(tiny / "hf", tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    assert_user_error(run_cli("convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out")),
                      "model.layers.1.self_attn.k_proj.weight")
    assert not (tmp_path / "out").exists()


def test_unused_tensor_names_key_and_candidates(tiny, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.q_norm.weight"] = t["model.norm.weight"].clone()

    src = _resave(tiny / "hf", tmp_path, add)
    result = run_cli("convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out"))
    assert_user_error(result, "model.layers.0.self_attn.q_norm.weight", "nearest")


def test_shape_mismatch_names_both_shapes(tiny, tmp_path):
    import torch

    def widen(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 81)

    src = _resave(tiny / "hf", tmp_path, widen)
    result = run_cli("convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "out"))
    assert_user_error(result, "model.layers.0.mlp.down_proj.weight", "(64, 81)", "(64, 80)")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("flags,words", [
    (["--tp_size", "3"], ["--tp_size 3", "divide"]),
    (["--dtype", "float8"], ["--dtype"]),
    (["--tp_size", "0"], ["--tp_size"]),
])
def test_bad_flag_values(tiny, tmp_path, flags, words):
    result = run_cli("convert", "--model_dir", str(tiny / "hf"), "--output_dir", str(tmp_path / "out"), *flags)
    assert_user_error(result, *words)
    assert not (tmp_path / "out").exists()


def test_run_errors(tiny, tmp_path):
    assert_user_error(run_cli("run", "--engine_dir", str(tmp_path / "none"), "--input_ids", "1"), "none")
    assert_user_error(run_cli("run", "--engine_dir", str(tiny / "engine"), "--input_ids", "1,x"), "--input_ids")
    assert_user_error(run_cli("run", "--engine_dir", str(tiny / "engine"), "--input_ids", "1,500"), "500")
    assert_user_error(run_cli("run", "--engine_dir", str(tiny / "engine"), "--input_text", "hi"), "tokenizer")


def test_build_refuses_max_seq_len_past_the_positions(tiny, tmp_path):
    result = run_cli("build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(tmp_path / "engine"),
                     "--max_seq_len", "4096")
    assert_user_error(result, "--max_seq_len 4096", "max_position_embeddings 128")
    assert not (tmp_path / "engine").exists()


def test_corrupt_engine_config(tiny, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(tiny / "engine", engine)
    config = json.loads((engine / "config.json").read_text())
    config["pretrained_config"]["num_attention_heads"] = "many"
    (engine / "config.json").write_text(json.dumps(config))
    assert_user_error(run_cli("run", "--engine_dir", str(engine), "--input_ids", "1"), "num_attention_heads",
                      "config.json")
