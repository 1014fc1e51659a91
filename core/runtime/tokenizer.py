"""The runtime tokenizer: a `tokenizers` tokenizer.json + HF-style tokenizer_config.json.

Chat templates are rendered with jinja2 in a sandbox, as HF does.
"""

from __future__ import annotations

import json
from pathlib import Path

from bestiary.core.format.errors import BestiaryError


def _token_text(value) -> str | None:
    """HF stores special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """encode / decode / chat template, with the special ids generation needs."""

    def __init__(self, tokenizer_json: str, config: dict) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.config = config
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
    def from_dir(cls, directory: Path) -> "Tokenizer | None":
        """The tokenizer stored in a checkpoint/engine dir, or None if it has none."""
        tok = Path(directory) / "tokenizer.json"
        if not tok.is_file():
            return None
        cfg_path = Path(directory) / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return cls(tok.read_text(), config)

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the chat template over [{"role": ..., "content": ...}, ...]."""
        if not self.chat_template:
            raise BestiaryError("this model has no chat template (tokenizer_config.json: chat_template)")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")


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
