"""Chat templates rendered as transformers' `apply_chat_template` renders them.

The template is jinja2 source (tokenizer_config.json `chat_template`, GGUF
`tokenizer.chat_template`, or a user's file) run in jinja2's immutable sandbox with what
transformers gives it (transformers/utils/chat_template_utils.py):

  environment: trim_blocks, lstrip_blocks, the loopcontrols extension ({% break %}),
               `{% generation %}...{% endgeneration %}` (rendered as its body);
  globals:     raise_exception(message), strftime_now(format);
  filters:     tojson (json.dumps, ensure_ascii=False: no HTML escaping);
  variables:   messages, tools, documents, add_generation_prompt and the special tokens
               (bos_token, eos_token, unk_token, pad_token).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from bestiary.core.format.errors import BestiaryError


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled jinja2 template of `source` (cached: a server renders one template per request)."""
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}` marks assistant text for training masks; rendering keeps its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateSyntaxError as err:
        raise BestiaryError(f"chat template: line {err.lineno}: {err.message}") from None


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]) under template `source`.

    A template's own `raise_exception` (e.g. "roles must alternate") becomes a BestiaryError.
    """
    from jinja2.exceptions import TemplateError

    try:
        return compile_template(source).render(messages=messages, tools=tools, documents=None,
                                               add_generation_prompt=add_generation_prompt, **(special_tokens or {}))
    except TemplateError as err:
        raise BestiaryError(f"chat template: {err}") from None
