"""The runtime tokenizer: a `tokenizers` tokenizer.json + HF-style tokenizer_config.json.

Chat templates are rendered with jinja2 in a sandbox, as HF does.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError

_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: no UTF-8 text (nor `tokenizers`) holds one


def _token_text(value) -> str | None:
    """HF stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _check_config(config: dict, source: str) -> None:
    """The tokenizer_config.json fields bestiary reads must have their HF types (one-line error)."""
    where = Path(source).with_name("tokenizer_config.json")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = _token_text(config.get(name))
        if value is not None and not isinstance(value, str):
            raise BestiaryError(f"{where}: {name} {value!r}: expected a token string")
        if value is not None and not value.isascii() and _SURROGATE.search(value):
            raise BestiaryError(f"{where}: {name} {value!r}: a lone surrogate is not text")
    template = config.get("chat_template")
    named_ok = isinstance(template, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys()
                                                  for t in template)
    if template is not None and not isinstance(template, str) and not named_ok:
        raise BestiaryError(f"{where}: chat_template: expected a template string or [{{name, template}}, ...]")
    extra = config.get("generation_eos_token_id")
    ids = extra if isinstance(extra, list) else [extra]
    if extra is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise BestiaryError(f"{where}: generation eos_token_id {extra!r}: expected token ids")


class Tokenizer:
    """encode / decode / chat template, with the special ids generation needs."""

    def __init__(self, tokenizer_json: str, config: dict, source: str = "tokenizer.json") -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception type
            raise BestiaryError(f"{source}: not a valid tokenizer.json ({str(err).splitlines()[0][:200]}); "
                                "replace it with the model's original") from None
        if not isinstance(config, dict):
            raise BestiaryError(f"{source}: tokenizer_config.json must hold a JSON object")
        self.source = source  # where the tokenizer was read from, for error messages
        self.config = config
        _check_config(config, source)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_id = self._id(self.bos_token)
        self.eos_id = self._id(self.eos_token)
        self.pad_id = self._id(self.pad_token)
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # HF's named templates
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values()), None))

    @classmethod
    def from_dir(cls, directory: Path) -> Tokenizer | None:
        """The tokenizer stored in a checkpoint/engine dir, or None if it has none."""
        tok = Path(directory) / "tokenizer.json"
        if not tok.is_file():
            return None
        cfg_path = Path(directory) / "tokenizer_config.json"
        config = read_json(cfg_path) if cfg_path.is_file() else {}
        try:
            text = tok.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise BestiaryError(f"{tok}: not a valid tokenizer.json (not UTF-8 text)") from None
        return cls(text, config, str(tok))

    def check_vocab(self, vocab_size: int, config_source: str) -> None:
        """The ids the engine inserts on its own (bos / eos / pad) are rows of the model's embedding,
        [0, vocab_size): else a one-line error naming the tokenizer file and the id (a tokenizer.json of
        another model). Other added tokens past the embedding are allowed, as in transformers: a model may
        ship spare ones; a prompt holding one is refused when it is submitted (Executor.add, evaluate)."""
        named = [(f"{name} {text!r}", token_id) for name, text, token_id in (
            ("bos_token", self.bos_token, self.bos_id), ("eos_token", self.eos_token, self.eos_id),
            ("pad_token", self.pad_token, self.pad_id))]
        for what, token_id in named:
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise BestiaryError(f"{self.source}: {what[:80]} has id {token_id}, outside the model's vocabulary "
                                    f"[0, {vocab_size}) ({config_source}: vocab_size); use the model's own tokenizer")

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def stop_ids(self) -> set[int]:
        """EOS plus any extra end ids from generation_config (e.g. <|eot_id|>)."""
        ids = {self.eos_id} if self.eos_id is not None else set()
        extra = self.config.get("generation_eos_token_id")
        if isinstance(extra, int):
            ids.add(extra)
        elif isinstance(extra, list):
            ids.update(extra)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (the tokenizer's post-processor adds BOS where configured)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.config.get("add_bos_token") and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json text (what the grammar compiler builds its token trie from)."""
        return self._tok.to_str()

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's string of each id (byte-level tokens as stored, e.g. 'Ġthe'); '' for none."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's text in UTF-8 bytes (added tokens included): one token covers at most this
        many bytes of input (a byte-level token's text has a character per byte, a SentencePiece one its
        text with '▁' for the space), so a text of B bytes is at least B / max_token_bytes tokens."""
        return max((len(t.encode("utf-8", "replace")) for t in self._tok.get_vocab(with_added_tokens=True)),
                   default=1) or 1

    def min_tokens(self, num_bytes: int) -> int:
        """A lower bound on the tokens of a text of `num_bytes` UTF-8 bytes, known without encoding it; halved
        for normalizers that drop characters (accents, padding), so it never refuses a text that fits."""
        return num_bytes // (2 * self.max_token_bytes)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render the chat template over [{"role": ..., "content": ...}, ...] as transformers does."""
        from bestiary.core.runtime.chat_template import render_chat

        if not self.chat_template:
            raise BestiaryError("this model has no chat template (tokenizer_config.json: chat_template)")
        try:
            return render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens, tools)
        except BestiaryError as err:  # name the file the template came from
            raise BestiaryError(f"{Path(self.source).with_name('tokenizer_config.json')}: {err}") from None

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token, pad_token: the ones the tokenizer config names."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        texts = {n: _token_text(self.config.get(n)) for n in names}
        return {n: text for n, text in texts.items() if text is not None}


class StreamDecoder:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        """Add one id; return the new text it completes (may be '')."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta
