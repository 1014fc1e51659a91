"""Rebuild a `tokenizers` tokenizer.json (+ tokenizer_config) from a GGUF file's metadata.

A GGUF carries no tokenizer.json: the vocabulary, merges, token types and special ids live in
`tokenizer.ggml.*` metadata under llama.cpp's names. This module rebuilds, from that metadata, the
same tokenizer transformers builds for `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
(transformers/integrations/gguf/gguf_tokenizer_mapping.py), so both give the same ids:

- `gpt2` (byte-level BPE): BPE over the vocabulary spelled in the GPT-2 byte alphabet, ByteLevel
  pre-tokenizer (GPT-2 regex) and decoder; for the `tokenizer.ggml.pre` names transformers knows,
  a Split on that model's regex followed by ByteLevel without regex.
- `llama` (SentencePiece BPE): BPE with byte fallback, merges from the file or derived from the
  scores, Metaspace pre-tokenizer (prepend "▁" to the first word only), no normalizer, and the
  Replace/ByteFallback/Fuse/Strip decoder.

Both then get: control tokens (token_type 3) and the named special tokens as special added tokens,
user-defined tokens (token_type 4) as plain added tokens, and a TemplateProcessing post-processor
adding BOS/EOS as `add_bos_token`/`add_eos_token` say.

transformers is deliberately not imported here: it is only a test dependency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from bestiary.core.format.errors import BestiaryError
from bestiary.core.sources.base import TokenizerFiles

# llama.cpp's `llama_token_type` values (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF metadata key -> name used below.
_TOKENIZER_KEYS: dict[str, str] = {
    "tokenizer.ggml.model": "model",
    "tokenizer.ggml.pre": "pre",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
    "tokenizer.chat_template": "chat_template",
}

# tokenizer_config name -> id key above.
_NAMED_SPECIAL_TOKENS: dict[str, str] = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unk_token_id",
    "pad_token": "pad_token_id",
}

# Default `add_bos_token` per tokenizer model when the file does not say (llama.cpp adds BOS to a
# SentencePiece vocabulary unless told otherwise; byte-level BPE adds nothing).
_DEFAULT_ADD_BOS: dict[str, bool] = {"gpt2": False, "llama": True}

# Special tokens the transformers tokenizer class behind each model registers by default
# (GPT2Tokenizer: "<|endoftext|>" as unk/bos/eos; LlamaTokenizer: "<unk>", "<s>", "</s>").
# They become special added tokens when the vocabulary has them.
_CLASS_DEFAULT_SPECIALS: dict[str, tuple[str, ...]] = {
    "gpt2": ("<|endoftext|>",),
    "llama": ("<unk>", "<s>", "</s>"),
}

# Architectures whose SentencePiece tokenizer transformers builds differently (Gemma's renamed
# space tokens, Phi-3's normalizer); not supported here.
_UNSUPPORTED_SENTENCEPIECE_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma4", "phi3"})

# Pre-tokenizer split regexes keyed by `tokenizer.ggml.pre`, as transformers applies them.
# A `pre` not listed here (e.g. "smollm", "gpt2", "default") keeps the plain ByteLevel GPT-2 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies use)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


# Short name -> (what its value must be, the check): the tables a tokenizer is built from.
_META_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model": ("a string", lambda v: isinstance(v, str)),
    "pre": ("a string", lambda v: isinstance(v, str)),
    "chat_template": ("a string", lambda v: isinstance(v, str)),
    "tokens": ("an array of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "merges": ("an array of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "scores": ("an array of numbers", lambda v: isinstance(v, list) and all(_is_number(x) for x in v)),
    "token_type": ("an array of integers", lambda v: isinstance(v, list) and all(_is_int(x) for x in v)),
    **{name: ("a token id", _is_int) for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id")},
    "add_bos_token": ("a boolean", lambda v: isinstance(v, bool)),
    "add_eos_token": ("a boolean", lambda v: isinstance(v, bool)),
}


def _read_metadata(reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` fields of a GGUFReader, under the short names of `_TOKENIZER_KEYS` (+ "path",
    the file); one of another type than `_META_TYPES` says is a one-line BestiaryError naming it."""
    path = _source_name(reader)
    meta: dict[str, Any] = {"path": path}
    for key, name in _TOKENIZER_KEYS.items():
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        expected, ok = _META_TYPES[name]
        if not ok(value):
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:60]}..."
            raise BestiaryError(f"{path}: GGUF metadata {key!r}: expected {expected} (got {shown})")
        meta[name] = value
    return meta


def _source_name(reader: Any) -> str:
    """The file a GGUFReader reads (for error messages)."""
    return str(getattr(reader.data, "filename", None) or "<gguf>")


def _architecture(reader: Any) -> str | None:
    """general.architecture, or None."""
    field = reader.fields.get("general.architecture")
    return field.contents() if field is not None else None


# ---- model builders: metadata -> (BPE model, pre_tokenizer, decoder) -------------------------------

Built = tuple[models.Model, Any, Any]


def _byte_level_bpe(meta: dict[str, Any]) -> Built:
    """Byte-level BPE (`gpt2`): tokens outside the byte alphabet are respelled in it, as transformers does."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta["tokens"])
    }
    model = models.BPE(
        vocab=vocab,
        merges=_merges(meta, vocab),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    return model, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()


def _sentencepiece_bpe(meta: dict[str, Any]) -> Built:
    """SentencePiece-style BPE (`llama`): byte fallback, "▁" for spaces, prefix "▁" on the first word only."""
    vocab = {token: index for index, token in enumerate(meta["tokens"])}
    model = models.BPE(
        vocab=vocab, merges=_merges(meta, vocab), fuse_unk=True, byte_fallback=True, dropout=None
    )
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return model, pre, decoder


_BUILDERS: dict[str, Callable[[dict[str, Any]], Built]] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
}


def _merges(meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges ("a b" strings), or ones derived from the scores when it has none. Each of the
    file's must name two tokens of the vocabulary whose concatenation is one too (as BPE needs)."""
    if "merges" in meta:
        pairs = [_merge_pair(merge) for merge in meta["merges"]]
        for index, (left, right) in enumerate(pairs):
            missing = next((t for t in (left, right, left + right) if t not in vocab), None)
            if missing is not None:
                raise BestiaryError(f"{meta['path']}: tokenizer.ggml.merges[{index}] {left + ' ' + right!r}: "
                                    f"token {missing!r} is not in tokenizer.ggml.tokens")
        return pairs
    if "scores" not in meta:
        return []
    return _merges_from_scores(vocab, dict(zip(meta["tokens"], meta["scores"])))


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge "left right" as (left, right)."""
    left, _, right = merge.partition(" ")
    return left, right


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best score first (transformers' generate_merges)."""
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


# ---- assembly ------------------------------------------------------------------------------------


def _special_token_names(meta: dict[str, Any]) -> dict[str, str | None]:
    """bos/eos/unk/pad token strings from their ids (None where the file gives no id)."""
    tokens = meta["tokens"]
    names: dict[str, str | None] = {}
    for name, id_key in _NAMED_SPECIAL_TOKENS.items():
        token_id = meta.get(id_key)
        names[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    return names


def _add_special_tokens(
    tokenizer: Tokenizer, meta: dict[str, Any], kind: str, named: dict[str, str | None]
) -> None:
    """Register control/named/class-default tokens as special, user-defined ones as plain added tokens.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel, and transformers skips it; so do we.
    """
    tokens, types = meta["tokens"], meta.get("token_type") or []
    alphabet = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [
        token
        for token, token_type in zip(tokens, types)
        if token_type == TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    user_defined = [
        token
        for token, token_type in zip(tokens, types)
        if token_type == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

    # Named specials, then the tokenizer class's defaults: only those that are real vocabulary
    # entries (transformers would append a missing one past the model's vocabulary size).
    extra = [t for t in (*named.values(), *_CLASS_DEFAULT_SPECIALS[kind]) if t is not None and t in vocab]
    known = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(extra) if t not in known]
    )


def _post_processor(bos: str | None, eos: str | None, vocab: dict[str, int]) -> processors.TemplateProcessing:
    """TemplateProcessing adding BOS/EOS around each sequence (transformers' update_post_processor).

    `bos` / `eos`: the token to add, or None for none (callers pass None when it is not in `vocab`).
    """
    single = f"{'' if bos is None else bos + ':0 '}$A:0{'' if eos is None else ' ' + eos + ':0'}"
    pair = f"{single}{'' if bos is None else ' ' + bos + ':1'} $B:1{'' if eos is None else ' ' + eos + ':1'}"
    special = ([] if bos is None else [(bos, vocab[bos])]) + ([] if eos is None else [(eos, vocab[eos])])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _build_model(meta: dict[str, Any], kind: str, path: str) -> Built:
    """`_BUILDERS[kind](meta)`; what `tokenizers` still refuses in the tables is one line naming the file."""
    try:
        return _BUILDERS[kind](meta)
    except BestiaryError:
        raise
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception for a table it cannot take
        reason = " ".join(str(err).split())[:200]
        raise BestiaryError(f"{path}: the GGUF tokenizer tables cannot build a {kind} tokenizer ({reason})") from None


def tokenizer_from_gguf(reader: Any) -> TokenizerFiles:
    """tokenizer.json text + tokenizer_config dict equivalent to transformers' tokenizer for this GGUF.

    `reader` is a `gguf.GGUFReader`. Raises BestiaryError (one line, naming the file) for a file
    without tokenizer metadata or with a tokenizer model other than `gpt2` / `llama`.
    """
    path = _source_name(reader)
    meta = _read_metadata(reader)
    kind = meta.get("model")
    if kind is None or "tokens" not in meta:
        raise BestiaryError(f"{path}: no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind not in _BUILDERS:
        raise BestiaryError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported "
            f"(supported: {', '.join(sorted(_BUILDERS))})"
        )
    arch = _architecture(reader)
    if kind == "llama" and arch in _UNSUPPORTED_SENTENCEPIECE_ARCHS:
        raise BestiaryError(f"{path}: SentencePiece tokenizer of architecture {arch!r} is not supported")

    model, pre_tokenizer, decoder = _build_model(meta, kind, path)
    tokenizer = Tokenizer(model)
    tokenizer.decoder = decoder
    split = PRE_TOKENIZER_SPLITS.get(meta.get("pre", ""))
    if split is not None:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.pre_tokenizer = pre_tokenizer

    named = _special_token_names(meta)
    _add_special_tokens(tokenizer, meta, kind, named)

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    add_bos = bool(meta.get("add_bos_token", _DEFAULT_ADD_BOS[kind])) and named["bos_token"] in vocab
    add_eos = bool(meta.get("add_eos_token", False)) and named["eos_token"] in vocab
    tokenizer.post_processor = _post_processor(
        named["bos_token"] if add_bos else None, named["eos_token"] if add_eos else None, vocab
    )

    config: dict[str, Any] = {
        **named,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("chat_template"),
    }
    return TokenizerFiles(tokenizer_json=tokenizer.to_str(), tokenizer_config=config)
