"""Chat templates for sources that carry a chat *format* rather than a template, and ChatGLM's tokens.

- FastLLM `.flm` files: the info keys pre_prompt / user_role / bot_role / history_sep
  (basellm::MakeInput / MakeHistory) -> `chat_templates/fastllm_roles.jinja` with the values filled in.
- THUDM ChatGLM (model_type "chatglm", no roles): the round format of its chat()
  (`chat_templates/chatglm_v1.jinja`, `chatglm_v2.jinja`).
- ChatGLM's special tokens and where a prompt gets them (FastLLM's ChatGLMModel::Response):
  v1 appends [gMASK] <sop> to the text's ids, v2/3 prefixes [gMASK] sop (`chatglm_post_processor`).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# THUDM's special tokens: v1 pieces of ice_text.model; v2/3 appended after the sentencepiece vocab.
CHATGLM_SPECIALS = {
    1: ("[MASK]", "[gMASK]", "[sMASK]", "<unused_0>", "<sop>", "<eop>", "<ENC>", "<dBLOCK>"),
    2: ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop"),
}
# Where the prompt's special tokens go: (before the text, after the text).
CHATGLM_PROMPT = {1: ((), ("[gMASK]", "<sop>")), 2: (("[gMASK]", "sop"), ())}
ROLE_KEYS = ("pre_prompt", "user_role", "bot_role", "history_sep")


def _template(name: str) -> str:
    return (resources.files("bestiary.core.sources") / "chat_templates" / name).read_text(encoding="utf-8")


def _literal(text: str) -> str:
    """A jinja string literal of `text` (jinja decodes its escapes as Python's unicode-escape)."""
    return json.dumps(text, ensure_ascii=True)


def fastllm_roles_template(roles: dict[str, str]) -> str:
    """The chat template of FastLLM's MakeInput / MakeHistory with these pre_prompt / roles / separator."""
    text = _template("fastllm_roles.jinja")
    for key in ROLE_KEYS:
        text = text.replace(f"__{key.upper()}__", _literal(roles.get(key, "")))
    return text


def chatglm_version(config: dict[str, Any]) -> int | None:
    """1 or 2 for a THUDM ChatGLM config (v1 has position_encoding_2d), None otherwise."""
    if config.get("model_type") != "chatglm":
        return None
    return 1 if "position_encoding_2d" in config else 2


def chat_template_for(config: dict[str, Any]) -> str | None:
    """The chat template an HF-style config implies: FastLLM roles when it has them, ChatGLM rounds."""
    if any(config.get(key) for key in ("user_role", "bot_role")):
        return fastllm_roles_template({k: str(config.get(k) or "") for k in ROLE_KEYS})
    version = chatglm_version(config)
    return None if version is None else _template(f"chatglm_v{version}.jinja")


def chatglm_post_processor(version: int, ids: dict[str, int]) -> dict[str, Any]:
    """tokenizers TemplateProcessing putting ChatGLM's prompt tokens around the text's ids."""
    before, after = CHATGLM_PROMPT[version]
    single = [{"SpecialToken": {"id": t, "type_id": 0}} for t in before]
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    single += [{"SpecialToken": {"id": t, "type_id": 0}} for t in after]
    specials = {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in before + after}
    return {"type": "TemplateProcessing", "single": single, "pair": single + [{"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": specials}
