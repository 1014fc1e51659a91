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

A render has a time and a size budget (core.runtime.chat_template_budget: 5 s, 64 Mi characters
of any value and of the prompt); every failure, to compile, to render, or to stay in budget, is
one BestiaryError line.
"""

from __future__ import annotations

import json
import traceback
from datetime import datetime
from functools import lru_cache

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.chat_template_budget import (
    TEMPLATE_BUDGET,
    TemplateBudgetError,
    budget_environment,
    budget_loops,
    render_budgeted,
    seal,
)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str, origin: str = "chat template"):
    """The compiled jinja2 template of `source` (cached: a server renders one template per request),
    in the budgeted sandbox (core.runtime.chat_template_budget). Any failure to compile, a Python
    one included (24 nested for loops pass jinja2's parser and fail Python's compiler), is one
    BestiaryError line starting with `origin`."""
    if not isinstance(source, str):
        raise BestiaryError(f"{origin}: expected a template string, got {type(source).__name__}")
    if len(source) > TEMPLATE_BUDGET:
        raise BestiaryError(f"{origin}: {len(source)} characters is over the budget of {TEMPLATE_BUDGET}")
    return _compile(source, origin)


@lru_cache(maxsize=8)
def _compile(source: str, origin: str):
    """compile_template's work, on a checked `source`."""
    from jinja2.exceptions import TemplateSyntaxError

    env = _environment()
    try:
        return env.from_string(budget_loops(env.parse(source)))
    except TemplateSyntaxError as err:
        raise BestiaryError(f"{origin}: line {err.lineno}: {err.message}") from None
    except Exception as err:  # noqa: BLE001 - Python's compiler and jinja2's parser on what they cannot take
        raise BestiaryError(f"{origin}: cannot be compiled ({_reason(err)})") from None


def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller (jinja2's undeclared names: `messages`, `tools`, ...);
    e.g. a template without "tools" among them renders no tool definitions (the server then describes them
    in a system message: core.serve.tools)."""
    compile_template(source)  # one that does not compile is one BestiaryError line
    return _variables(source)


@lru_cache(maxsize=8)
def _variables(source: str) -> frozenset[str]:
    """template_variables' work, on a template that compiles."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


def _environment():
    """The sandbox transformers renders in (module docstring), with the time and size budget."""
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        """`{% generation %}` marks assistant text for training masks; rendering keeps its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = budget_environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    seal(env)
    return env


def _reason(err: BaseException) -> str:
    """`Type: the message on one line` (200 characters at most; a SyntaxError's without the line of
    the Python code jinja2 generated, which is not the template's)."""
    message = err.msg if isinstance(err, SyntaxError) else str(err)
    text = " ".join(message.split())[:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _line(err: BaseException) -> str:
    """'line N: ' of the template line the error was raised on ('' when its traceback does not say)."""
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == "<template>"]
    return f"line {lines[-1]}: " if lines else ""


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, tools: list[dict] | None = None,
                origin: str = "chat template") -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]) under template `source`.

    Whatever stops the template is one BestiaryError line starting with `origin`: its own
    `raise_exception` (e.g. "roles must alternate"), an error of what it runs, or its budget
    (RENDER_SECONDS, TEXT_BUDGET: core.runtime.chat_template_budget).
    """
    from jinja2.exceptions import TemplateError

    template = compile_template(source, origin)
    variables = dict(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                     **(special_tokens or {}))
    try:
        return render_budgeted(template, variables)
    except TemplateBudgetError as err:
        raise BestiaryError(f"{origin}: {_line(err)}stopped: {err}") from None
    except TemplateError as err:
        raise BestiaryError(f"{origin}: {_line(err)}{' '.join(str(err).split())[:200]}") from None
    except Exception as err:  # noqa: BLE001 - anything a template's own code raises (RecursionError included)
        raise BestiaryError(f"{origin}: {_line(err)}rendering failed ({_reason(err)})") from None
