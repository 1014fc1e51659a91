"""`tokenizers` tokenizers rebuilt from a bare vocab: pieces, ids and scores.

Two sources have only that: FastLLM's `.flm` vocab section and sentencepiece `.model` files
(core.sources.sp_model). Both are turned into a tokenizer.json:

- sentencepiece Unigram (a `.model` whose trainer says unigram, a `.flm` vocab whose scores are
  not all integers): a `Unigram` model over
  (piece, score) in id order; the Viterbi segmentation is sentencepiece's.
- BPE (sentencepiece BPE, and `.flm` vocabs whose scores are ranks: GPT-2 byte-level merges,
  sentencepiece BPE): a `BPE` model whose merges come from the scores
  (`merges_from_scores`, sentencepiece's rule: a piece a+b is made from pieces a and b, pieces
  in descending score order).
- pieces are either sentencepiece text ("▁" for a space; Metaspace pre-tokenizer, byte pieces
  <0xNN> as byte fallback) or GPT-2 byte-level text (`byte_level`: ByteLevel pre-tokenizer and
  decoder, FastLLM's tokenizer_byte_as_char).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from bestiary.core.format.errors import BestiaryError
from bestiary.core.sources.base import TokenizerFiles
from bestiary.core.sources.flm_reader import FlmFile

SPACE = "\u2581"  # sentencepiece's "▁"
BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class Vocab:
    """A bare vocabulary: pieces in id order (None where an id has no piece), scores, specials."""

    pieces: list[str | None]
    scores: list[float]
    unigram: bool = False  # sentencepiece unigram (else BPE merges from the scores)
    byte_level: bool = False  # GPT-2 byte-level pieces
    add_dummy_prefix: bool = True  # a "▁" before the text (sentencepiece's add_dummy_prefix)
    special: list[str] = field(default_factory=list)  # matched whole on the raw text, never split
    user_defined: list[str] = field(default_factory=list)  # matched whole on the normalized text
    unk: str | None = None
    normalizers: list[dict[str, Any]] = field(default_factory=list)  # tokenizers normalizer JSON, in order
    decoders: list[dict[str, Any]] = field(default_factory=list)  # after the piece decoding, in order


def merges_from_scores(pieces: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges from scored pieces: for each piece in descending score (then id) order, every split
    a + b into two pieces of the vocab, splits ordered by the ids of (a, b)."""
    merges: list[tuple[float, int, tuple[int, int], tuple[str, str]]] = []
    for piece, pid in pieces.items():
        for i in range(1, len(piece)):
            a, b = piece[:i], piece[i:]
            if a in pieces and b in pieces:
                merges.append((-scores[piece], pid, (pieces[a], pieces[b]), (a, b)))
    merges.sort(key=lambda m: (m[0], m[1], m[2]))
    return [m[3] for m in merges]


def _normalizer(vocab: Vocab) -> dict[str, Any] | None:
    return {"type": "Sequence", "normalizers": vocab.normalizers} if vocab.normalizers else None


def _pre_tokenizer(vocab: Vocab) -> dict[str, Any]:
    if vocab.byte_level:
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    scheme = "always" if vocab.add_dummy_prefix else "never"
    return {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": False}


def _decoder(vocab: Vocab) -> dict[str, Any]:
    steps: list[dict[str, Any]]
    if vocab.byte_level:
        steps = [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]
    else:
        steps = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                 {"type": "ByteFallback"}, {"type": "Fuse"}]
        if vocab.add_dummy_prefix:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": steps + vocab.decoders}


def _model(vocab: Vocab) -> dict[str, Any]:
    byte_fallback = any(p is not None and BYTE_PIECE.match(p) for p in vocab.pieces)
    ids = {p: i for i, p in enumerate(vocab.pieces) if p is not None}
    unk_id = ids.get(vocab.unk) if vocab.unk is not None else None
    if vocab.unigram:
        return {"type": "Unigram", "unk_id": unk_id, "byte_fallback": byte_fallback,
                "vocab": [[p if p is not None else f"<unused_{i}>", s] for i, (p, s) in
                          enumerate(zip(vocab.pieces, vocab.scores))]}
    scores = {p: vocab.scores[i] for p, i in ids.items()}
    whole = set(vocab.special) | set(vocab.user_defined)
    mergeable = {p: i for p, i in ids.items() if p not in whole}
    merges = merges_from_scores(mergeable, scores)
    return {"type": "BPE", "dropout": None, "unk_token": vocab.unk if unk_id is not None else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": not vocab.byte_level,
            "byte_fallback": byte_fallback and not vocab.byte_level, "ignore_merges": False,
            "vocab": ids, "merges": [[a, b] for a, b in merges]}


def tokenizer_json(vocab: Vocab, post_processor: dict[str, Any] | None = None) -> str:
    """tokenizer.json text of `vocab` (special tokens as added tokens, `post_processor` as given)."""
    ids = {p: i for i, p in enumerate(vocab.pieces) if p is not None}
    # user-defined pieces: a unigram model's Viterbi picks them whole (score 0, as sentencepiece does);
    # BPE has no merges for them, so they are added tokens there
    whole = vocab.special + ([] if vocab.unigram else vocab.user_defined)
    added = [{"id": ids[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": t in vocab.user_defined, "special": t not in vocab.user_defined}
             for t in dict.fromkeys(whole) if t in ids]
    data = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": _normalizer(vocab), "pre_tokenizer": _pre_tokenizer(vocab),
            "post_processor": post_processor, "decoder": _decoder(vocab), "model": _model(vocab)}
    return json.dumps(data, ensure_ascii=False)


# ---- .flm vocab ----------------------------------------------------------------------------------


def vocab_from_flm(entries: list[tuple[bytes, int, float | None]], info: dict[str, str], special: list[str]) -> Vocab:
    """A Vocab from a .flm vocab section (score -i when the file has none, as FastLLM reads it)."""
    size = max((e[1] for e in entries), default=-1) + 1
    pieces: list[str | None] = [None] * size
    scores = [0.0] * size
    for i, (raw, token_id, score) in enumerate(entries):
        if token_id < 0:
            continue
        pieces[token_id] = raw.decode("utf-8", errors="replace")
        scores[token_id] = -float(i) if score is None else float(score)
    byte_level = info.get("tokenizer_byte_as_char") == "True"
    dummy = info.get("tokenizer_add_dummy_prefix", "True") == "True" and not byte_level
    # a sentencepiece unigram vocab has log-probability scores; BPE ones are ranks (integers)
    unigram = not byte_level and any(s != int(s) for s in scores)
    return Vocab(pieces, scores, unigram=unigram, byte_level=byte_level, add_dummy_prefix=dummy,
                 special=list(special), unk="<unk>" if "<unk>" in pieces else None)


def _token_name(pieces: list[str | None], value: object) -> str | None:
    """The piece of token id `value` (or of the first id of a list that has one), else None."""
    ids = value if isinstance(value, list) else [value]
    for token_id in ids:
        if isinstance(token_id, int) and 0 <= token_id < len(pieces) and pieces[token_id] is not None:
            return pieces[token_id]
    return None


def _stored_config(flm: FlmFile) -> dict[str, Any]:
    """The tokenizer_config bestiary stored in the model info (a JSON object; else a one-line error)."""
    text = flm.info.get("bestiary.tokenizer_config", "{}")
    try:
        stored = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise BestiaryError(f"{flm.path}: model info 'bestiary.tokenizer_config' is not JSON ({err})") from None
    if not isinstance(stored, dict):
        raise BestiaryError(f"{flm.path}: model info 'bestiary.tokenizer_config': expected a JSON object, "
                            f"got {type(stored).__name__}")
    return stored


def tokenizer_from_flm(flm: FlmFile, config: dict[str, Any]) -> TokenizerFiles | None:
    """The tokenizer of a .flm file: the tokenizer.json bestiary stored in the info, or one rebuilt
    from the vocab section; FastLLM's chat keys become the chat template (core.sources.chat_formats)."""
    from bestiary.core.sources.chat_formats import chat_template_for, chatglm_version

    info = flm.info
    if "bestiary.tokenizer_json" in info:
        return TokenizerFiles(info["bestiary.tokenizer_json"], _stored_config(flm))
    if not flm.vocab:
        return None
    vocab = vocab_from_flm(flm.vocab, info, flm.special_tokens)
    if chatglm_version(config) is not None:
        from bestiary.core.sources.sp_model import chatglm_tokenizer

        return chatglm_tokenizer(vocab, config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        name = _token_name(vocab.pieces, config.get(key))
        if name is not None and name not in vocab.special:
            vocab.special.append(name)
    tok_config: dict[str, Any] = {}
    for key in ("bos", "eos", "pad"):
        name = _token_name(vocab.pieces, config.get(f"{key}_token_id"))
        if name is not None:
            tok_config[f"{key}_token"] = name
    template = info.get("chat_template") or chat_template_for(config)
    if template:
        tok_config["chat_template"] = template
    return TokenizerFiles(tokenizer_json(vocab), tok_config)
