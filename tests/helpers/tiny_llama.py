"""A tiny random HF LLaMA saved in several source formats, shared by the CLI/loader tests."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(tmp_path: Path, seed: int = 0, **overrides) -> Path:
    """Save a 2-layer HF LlamaForCausalLM (GQA 4/2, hidden 64) to tmp_path/'hf'; return the dir."""
    import parity
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    cfg.update(overrides)
    model = parity.reinit_(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)), seed)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    return out


WORDS = [f"w{i}" for i in range(90)]


TINY_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_tiny_tokenizer(directory: Path, chat_template: str | None = TINY_TEMPLATE) -> None:
    """A 96-token word-level tokenizer.json + tokenizer_config.json (ids fit the tiny model's vocab)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *WORDS, "a", "b", "c"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (directory / "tokenizer.json").write_text(tok.to_str())
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_engine(base: Path, tokenizer: bool = False, ckpt: str = "ckpt") -> Path:
    """make_tiny_llama into base/'hf' (with write_tiny_tokenizer if asked), converted by the CLI into
    base/ckpt and built into base/'engine' (max_seq_len 96); returns base."""
    from bestiary.core.cli.main import main

    src = make_tiny_llama(base)
    if tokenizer:
        write_tiny_tokenizer(src)
    assert main(["convert", "--model_dir", str(src), "--output_dir", str(base / ckpt)]) == 0
    assert main(["build", "--checkpoint_dir", str(base / ckpt), "--output_dir", str(base / "engine"),
                 "--max_seq_len", "96"]) == 0
    return base
