"""ChatGLM from text: THUDM sentencepiece tokenizers (converted to `tokenizers`, no sentencepiece at run
time), ChatGLM's special tokens, FastLLM's prompt tokens and chat rounds, `bestiary run --chat`."""

from __future__ import annotations

import io
import json
import struct
from importlib import resources

import pytest
import torch

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

import parity
import test_chatglm as cg

from bestiary.core.cli.main import main
from bestiary.core.convert.source_to_checkpoint import convert
from bestiary.core.runtime.tokenizer import Tokenizer
from bestiary.core.sources import open_source
from bestiary.core.sources.sp_model import parse_sp_model, vocab_from_sp
from bestiary.core.sources.vocab_tokenizer import tokenizer_json

V1_SYMBOLS = ["[MASK]", "[gMASK]", "[sMASK]", "<unused_0>", "<sop>", "<eop>", "<ENC>", "<dBLOCK>", "<n>", "<|tab|>",
              "<|blank_2|>", "<|blank_3|>", "<|blank_4|>"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "  leading and   inner   spaces  ", "naïve café ＡＢＣ ①",
         "emoji 🙂 and unseen 漢字", "numbers 12,345.67 and symbols #@!", "x", ""]


def corpus() -> list[str]:
    text = resources.files("bestiary.core.quant").joinpath("data", "weight_calibration.txt").read_text()[:6000]
    return [line for line in text.splitlines() if line.strip()]


def train(model_type: str, vocab_size: int, symbols: list[str]) -> bytes:
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=out, vocab_size=vocab_size,
                                   model_type=model_type, user_defined_symbols=symbols, byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2)
    return out.getvalue()


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_converted_sentencepiece_encodes_and_decodes_as_sentencepiece(model_type):
    proto = train(model_type, 400, ["[MASK]", "[gMASK]", "<sop>", "<eop>"])
    ref = spm.SentencePieceProcessor(model_proto=proto)
    ours = Tokenizer(tokenizer_json(vocab_from_sp(parse_sp_model(proto))), {})
    for text in TEXTS + corpus()[:40]:
        ids = ref.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


def chatglm_dir(tmp_path, version: int):
    """A tiny THUDM ChatGLM dir (random weights, THUDM names) with a sentencepiece model trained here."""
    d = tmp_path / f"v{version}"
    d.mkdir()
    if version == 1:
        proto = train("unigram", 500, V1_SYMBOLS)
        sp = spm.SentencePieceProcessor(model_proto=proto)
        (d / "ice_text.model").write_bytes(proto)
        ids = {t: sp.piece_to_id(t) for t in V1_SYMBOLS}
        cfg = {**cg.V1_CONFIG, "vocab_size": sp.get_piece_size(), "bos_token_id": ids["<sop>"],
               "eos_token_id": ids["<eop>"], "mask_token_id": ids["[MASK]"], "gmask_token_id": ids["[gMASK]"]}
        cg.write_source(d, cg.v1_weights(cfg), cfg)
        tok_config = {"tokenizer_class": "ChatGLMTokenizer", "num_image_tokens": 0}
    else:
        proto = train("bpe", 500, [])
        (d / "tokenizer.model").write_bytes(proto)
        vocab = 500 + 5 + 3  # the pieces, [MASK] [gMASK] [sMASK] sop eop, padding
        glm = parity.reinit_(transformers.GlmForCausalLM(transformers.GlmConfig(**{**cg.GLM_CONFIG, "vocab_size": vocab})), 3)
        cfg = {**cg.thudm_v2_config(glm.config.to_dict(), True), "eos_token_id": 2}
        cg.write_source(d, cg.thudm_v2_weights(glm, True), cfg)
        tok_config = {"tokenizer_class": "ChatGLMTokenizer"}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return d, spm.SentencePieceProcessor(model_proto=proto)


HISTORY = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
           {"role": "user", "content": "what is\tnew?"}]
ROUNDS = {1: "[Round 0]\n问：hello there\n答：hi\n[Round 1]\n问：what is\tnew?\n答：",
          2: "[Round 1]\n\n问：hello there\n\n答：hi\n\n[Round 2]\n\n问：what is\tnew?\n\n答："}


@pytest.mark.parametrize("version", [1, 2])
def test_chatglm_prompts_as_fastllm_builds_them(tmp_path, version):
    d, sp = chatglm_dir(tmp_path, version)
    files = open_source(d).tokenizer
    tok = Tokenizer(files.tokenizer_json, files.tokenizer_config)
    assert tok.apply_chat_template(HISTORY) == ROUNDS[version]
    assert tok.apply_chat_template(HISTORY[:1]) == ("hello there" if version == 1 else "[Round 1]\n\n问：hello there\n\n答：")
    text = "hello there"
    ids = tok.encode(text)
    if version == 1:  # ChatGLMModel::Response v1: the text's ids, then [gMASK] <sop>
        assert ids == sp.encode(text) + [sp.piece_to_id("[gMASK]"), sp.piece_to_id("<sop>")]
        assert tok.encode("a\nb\tc  d", add_special_tokens=False) == sp.encode("a<n>b<|tab|>c<|blank_2|>d")
        assert tok.decode(tok.encode("a\nb\tc  d", add_special_tokens=False)) == "a\nb\tc  d"
    else:  # v2: [gMASK] sop, then the text's ids
        n = sp.get_piece_size()
        assert ids == [n + 1, n + 3] + sp.encode(text)
        assert tok.eos_token == "</s>"


@pytest.mark.parametrize("version", [1, 2])
def test_run_chat_from_text(tmp_path, capsys, version):
    d, _ = chatglm_dir(tmp_path, version)
    ck, engine = tmp_path / "ck", tmp_path / "engine"
    convert(d, ck, show_progress=False)
    assert main(["build", "--checkpoint_dir", str(ck), "--output_dir", str(engine)]) == 0
    code = main(["run", "--engine_dir", str(engine), "--input_text", "hello there", "--chat",
                 "--max_output_len", "4", "--output_ids"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip()


def flm_v1_by_hand(tmp_path, proto: bytes, cfg: dict, weights: dict[str, torch.Tensor]):
    """A ChatGLM v1 .flm written byte by byte as FastLLM's torch2flm.tofile writes it (sentencepiece
    vocab with scores, THUDM names, float32), without bestiary's writer."""
    sp = spm.SentencePieceProcessor(model_proto=proto)

    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack("<i", len(b)) + b

    info = {k: str(v) for k, v in cfg.items()} | {"tokenizer_use_score": "1", "tokenizer_add_dummy_prefix": "True"}
    data = struct.pack("<ii", 2, len(info)) + b"".join(s(k) + s(v) for k, v in sorted(info.items()))
    data += struct.pack("<i", sp.get_piece_size())
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i).encode()
        data += struct.pack(f"<{len(piece) + 2}i", len(piece), *piece, i) + struct.pack("<f", sp.get_score(i))
    data += struct.pack("<i", len(weights))
    for name, t in weights.items():
        data += s(name) + struct.pack(f"<{t.dim() + 2}i", t.dim(), *t.shape, 0) + t.float().numpy().tobytes()
    path = tmp_path / "chatglm.flm"
    path.write_bytes(data)
    return path


def test_chatglm_v1_flm_from_text(tmp_path, capsys):
    d, sp = chatglm_dir(tmp_path, 1)
    cfg = json.loads((d / "config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(next(d.glob("*.safetensors")))
    flm = flm_v1_by_hand(tmp_path, (d / "ice_text.model").read_bytes(), cfg, weights)
    source = open_source(flm)
    tok = Tokenizer(source.tokenizer.tokenizer_json, source.tokenizer.tokenizer_config)
    assert tok.apply_chat_template(HISTORY) == ROUNDS[1]
    assert tok.encode("hello there") == sp.encode("hello there") + [sp.piece_to_id("[gMASK]"), sp.piece_to_id("<sop>")]
    convert(flm, tmp_path / "ck", show_progress=False)
    convert(d, tmp_path / "ref", show_progress=False)
    prompt = sp.encode("hello there") + [sp.piece_to_id("[gMASK]"), sp.piece_to_id("<sop>")]
    from bestiary.core.runtime.engine import Engine

    ours = parity.EngineRunner(Engine.load(tmp_path / "ck")).feed(prompt, all_logits=True)
    ref = parity.EngineRunner(Engine.load(tmp_path / "ref")).feed(prompt, all_logits=True)
    assert torch.equal(ours, ref)
    code = main(["run", "--engine_dir", str(tmp_path / "ck"), "--input_text", "hello there", "--chat",
                 "--max_output_len", "3"])
    assert code == 0
