"""Fuzz cases of chat templates: hostile jinja (loops and ranges too big to finish, string and list
multiplication, deep nesting, recursion, undefined names, sandbox escapes, syntax errors, non-text
output), placed where bestiary reads templates (an engine's tokenizer_config.json, an HF dir's, a
GGUF's tokenizer.chat_template, `serve --chat_template FILE`) and rendered by a command."""

from __future__ import annotations

import json
import random

from fuzz_cases import Base, Case, new_case

HUGE = ["10**9", "2**62", "10**18", "999999999999"]
BIG_MUL = ["4000000000", "10**10", "2**40", "100000000"]


def _loops(rng: random.Random) -> str:
    n = rng.choice(HUGE)
    return rng.choice([
        f"{{% for i in range({n}) %}}x{{% endfor %}}",
        f"{{% for i in range({n}) %}}{{% endfor %}}{{{{ messages[0]['content'] }}}}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        f"{{{{ range({n}) | list | length }}}}",
        f"{{{{ range({n}) | sum }}}}",
        "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        f"{{% set ns = namespace(s='x') %}}{{% for i in range({n}) %}}{{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}",
        "{% for i in range(-1, -10**9, -1) %}.{% endfor %}",
        "{{ lipsum(10**6) }}",
    ])


def _sizes(rng: random.Random) -> str:
    m = rng.choice(BIG_MUL)
    return rng.choice([
        f"{{{{ 'x' * {m} }}}}", f"{{{{ [1] * {m} }}}}", f"{{{{ 'ab' * {m} | length }}}}",
        f"{{{{ messages[0]['content'] * {m} }}}}", "{{ 10 ** 10 ** 10 }}", "{{ 2 ** 100000000 }}",
        "{{ 'x'.center(10**10) }}", "{{ 'x' | indent(10**9) }}", "{{ '%0*d' % (10**9, 1) }}",
        "{{ '{:>1000000000}'.format('x') }}", "{{ 'x' * 1000000 }}", "{{ ('x' * 100000) | wordwrap(1) }}",
        "{{ 'x' | truncate(-1) }}", "{{ 'x' | center(-5) }}",
    ])


def _errors(rng: random.Random) -> str:
    return rng.choice([
        "{{ undefined_name.attr }}", "{{ undefined_fn() }}", "{{ messages[99]['content'] }}", "{{ messages.x.y }}",
        "{{ raise_exception('template says no') }}", "{{ raise_exception(messages) }}", "{{ 1 / 0 }}",
        "{{ 1 // 0 }}", "{{ 'a' + 1 }}", "{{ 'a' - 1 }}", "{{ none.x }}", "{{ [] | first | upper }}",
        "{{ 'x' | int('a') }}", "{{ {}|dictsort(by='nope') }}", "{{ 'x' | format(1, 2, 3) }}",
        "{{ '%s %s' % ('a',) }}", "{{ strftime_now(1) }}", "{{ strftime_now('%' * 1000) }}",
        "{{ 'x' | tojson(indent='x') }}", "{{ messages | tojson(sort_keys=1, separators=5) }}",
        "{{ messages.__class__ }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ self.__init__ }}", "{{ messages.append(1) }}", "{{ messages.clear() }}", "{% set x = messages.pop() %}",
        "{% include 'other.jinja' %}", "{% extends 'base.jinja' %}", "{% import 'os' as os %}{{ os.system('x') }}",
        "{{ x | nosuchfilter }}", "{% if x is nosuchtest %}{% endif %}",
        "{% generation %}x{% endgeneration %}{{ 1/0 }}",
    ])


def _syntax(rng: random.Random) -> str:
    depth = rng.choice([100, 500, 3000])
    return rng.choice([
        "{% for %}", "{{", "{% endfor %}", "{% if %}x", "{{ messages[ }}", "{% block a %}{% block a %}",
        "{% if true %}" * depth + "x" + "{% endif %}" * depth,
        "{{ " + "(" * depth + "1" + ")" * depth + " }}",
        "{{ " + "[" * depth + "]" * depth + " }}",
        "{{ " + "-" * depth + "1 }}",
        "{% for m in messages %}" * depth + "{% endfor %}" * depth,
        "{{ 'unterminated }}", "\x00{{ 1 }}", "{# never closed", "{% raw %}", "{{ 1 }}" * 100000,
        "{% set %}", "{% macro %}", "{% break %}", "{% generation %}",
    ])


def hostile_template(rng: random.Random) -> tuple[str, str]:
    """(family, template source)."""
    family = rng.choice(["loop", "size", "error", "syntax"])
    make = {"loop": _loops, "size": _sizes, "error": _errors, "syntax": _syntax}[family]
    return family, make(rng)


def _with_config(base: Base, rel: str, template: str) -> bytes:
    config = json.loads(base.read(rel))
    config["chat_template"] = template
    return json.dumps(config).encode()


def template_case(rng: random.Random, base: Base) -> Case:
    """A hostile template where a command reads it, and the command that renders (or loads) it."""
    family, template = hostile_template(rng)
    what = f"{family} template {template[:70]!r}"
    where = rng.choice(["engine", "engine", "engine", "serve", "hf", "gguf"])
    if where == "engine":
        files = {"engine/tokenizer_config.json": _with_config(base, "engine/tokenizer_config.json", template)}
        return new_case(f"engine chat_template: {what}", rng.choice(["run_chat", "run_chat", "chat"]), files)
    if where == "serve":
        argv = ["serve", "--engine_dir", "{W}/engine", "--port", "0", "--chat_template", "{W}/template.jinja"]
        return new_case(f"serve --chat_template: {what}", argv, {"template.jinja": template.encode("utf-8")})
    if where == "hf":
        files = {"hf/tokenizer_config.json": _with_config(base, "hf/tokenizer_config.json", template)}
        argv = ["run", "--engine_dir", "{W}/hf", "--input_text", "w1", "--max_output_len", "2", "--chat"]
        return new_case(f"HF chat_template: {what}", rng.choice([argv, "convert_hf"]), files)
    return _gguf_template_case(rng, base, what, template)


def _gguf_template_case(rng: random.Random, base: Base, what: str, template: str) -> Case:
    """The template as a GGUF's tokenizer.chat_template, converted, or run from the GGUF."""
    import tempfile
    from pathlib import Path

    import fuzz_base
    from gguf import GGUFValueType

    meta = fuzz_base.gguf_metadata("llama")
    meta["tokenizer.chat_template"] = (template, GGUFValueType.STRING, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.gguf"
        fuzz_base.write_gguf(out, "llama", meta)
        data = out.read_bytes()
    argv = ["run", "--engine_dir", "{W}/model.gguf", "--input_text", "a b", "--max_output_len", "2", "--chat"]
    return new_case(f"GGUF chat_template: {what}", rng.choice([argv, "convert_gguf"]), {"model.gguf": data})
