"""Chat templates under a time and size budget (core.runtime.chat_template_budget): every failure to
compile, to render or to stay in budget is one BestiaryError line, fast, with bounded memory (issue 46,
item 6: `range(10**9)` was an OverflowError, `'x' * 4000000000` allocated 4 GB at compile time, 25
nested loops a bare SyntaxError from LLM.chat_ids); and real templates render exactly as before."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
from tiny_llama import write_tiny_tokenizer

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime import chat_template_budget as budget
from bestiary.core.runtime.chat_template import compile_template, render_chat
from bestiary.core.runtime.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "hi"}]
NESTED_25 = "{% for i in [1] %}" * 25 + "x" + "{% endfor %}" * 25


def fails(template: str, *words: str, seconds: float = 2.0) -> str:
    """render_chat(template) must raise one BestiaryError line holding `words` within `seconds`."""
    start = time.monotonic()
    with pytest.raises(BestiaryError) as err:
        render_chat(template, CHAT)
    message = str(err.value)
    assert "\n" not in message and message.startswith("chat template: "), message
    for word in words:
        assert word in message, message
    assert time.monotonic() - start < seconds, message
    return message


@pytest.mark.parametrize(("template", "words"), [
    ("{% for i in range(10**9) %}{% endfor %}x", ("line 1", "range() argument 1000000000 is over the size budget")),
    ("{{ range(100001)|list|length }}", ("OverflowError", "MAX_RANGE")),
    ("a\nb\n{{ 'x' * 4000000000 }}", ("line 3", "repeated value of 4000000000 characters")),
    ("{{ [0] * 10**8 }}", ("100000000 items",)),
    ("{{ 'x'.center(10**10) }}", ("argument", "over the size budget")),
    ("{{ 'x'|center(10**10) }}", ("argument", "over the size budget")),
    ("{{ '%0999999999d' % 1 }}", ("format width of 999999999",)),
    ("{{ '{:>999999999}'.format(1) }}", ("format width of 999999999",)),
    ("{{ '%0999999999d'|format(1) }}", ("format width",)),
    ("{{ '%0*d' % (10**9, 1) }}", ("argument 1000000000",)),
    ("{{ 'x'|indent(10**9) }}", ("indent() argument",)),
    ("{{ 10 ** 10000000 }}", ("a power of",)),
    ("{{ ('ab' * 1000)|replace('a', 'x' * 100000) }}", ("replaced text",)),
    ("{{ range(100000)|join('x' * 10000) }}", ("joined text",)),
    ("{{ ','.join(['ab' * 30000] * 3000) }}", ("joined text",)),
    ("{{ lipsum(100000000) }}", ("argument", "over the size budget")),
    ("{% set ns = namespace(s='xxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
     "{{ ns.s|length }}", ("a text of",)),
    ("{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}{{ x|length }}", ("a text of",)),
    ("{% for i in range(100000) %}{{ 'x' * 60000000 }}{% endfor %}", ("the rendered prompt",)),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ("RecursionError",)),
    ("{{ 1/0 }}", ("line 1", "ZeroDivisionError")),
    ("{{ raise_exception('roles must alternate') }}", ("roles must alternate",)),
])
def test_a_hostile_template_is_one_line_fast(template, words):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (min(4 * 2**30 + _address_space(), hard), hard))  # a 4 GB try fails
    try:
        fails(template, *words)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space() -> int:
    """Bytes of address space this process maps now (the limit above is on top of it; without
    /proc, a limit no allocation reaches)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return 2**60
    return sum(int(end, 16) - int(start, 16) for start, end in
               (line.split()[0].split("-") for line in maps.read_text().splitlines()))


def test_loops_that_never_end_stop_at_the_time_budget(monkeypatch):
    """Nested loops over a list do no call, filter or lookup: only the per-iteration check sees them."""
    monkeypatch.setattr(budget, "RENDER_SECONDS", 0.3)
    monkeypatch.setattr(budget, "ITERATIONS_BUDGET", 10**9)
    fails("{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
          "time budget of 0.3 s")


def test_loops_stop_at_the_iteration_budget(monkeypatch):
    monkeypatch.setattr(budget, "ITERATIONS_BUDGET", 1000)
    fails("{% for a in range(100) %}{% for b in range(100) %}{% endfor %}{% endfor %}", "1000 iterations")


@pytest.mark.parametrize(("template", "words"), [
    (NESTED_25, ("cannot be compiled", "SyntaxError: too many statically nested blocks")),
    ("{{ " + "(" * 300 + "1" + ")" * 300 + " }}", ("cannot be compiled",)),
    ("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}", ("line 2",)),
])
def test_a_template_that_cannot_compile_is_one_line(template, words):
    with pytest.raises(BestiaryError) as err:
        compile_template(template)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value
    assert "<template>" not in str(err.value)  # not the line of jinja2's generated Python


def test_compile_refuses_a_non_string_and_a_huge_template():
    with pytest.raises(BestiaryError, match="expected a template string, got list"):
        compile_template(["x"])  # type: ignore[arg-type]
    with pytest.raises(BestiaryError, match="over the budget"):
        compile_template("x" * (budget.TEMPLATE_BUDGET + 1))


def test_compiling_does_not_evaluate_constants():
    """jinja2's constant folding ran 'x' * 4000000000 inside compile (147 s and 12 GB for `convert`)."""
    start = time.monotonic()
    compile_template("{{ 'x' * 4000000000 }}")
    assert time.monotonic() - start < 2


def test_llm_chat_ids_path_names_the_tokenizer_config(tmp_path):
    """Tokenizer.apply_chat_template (what LLM.chat_ids renders with): a BestiaryError naming the file."""
    write_tiny_tokenizer(tmp_path, chat_template=NESTED_25)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok = Tokenizer((tmp_path / "tokenizer.json").read_text(), config, str(tmp_path / "tokenizer.json"))
    with pytest.raises(BestiaryError, match=r"tokenizer_config.json: chat template: cannot be compiled \(SyntaxError"):
        tok.apply_chat_template(CHAT)


def _plain_render(source: str, **variables) -> str:
    """The sandbox as it was before the budget (the reference real templates must still match)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from bestiary.core.runtime import chat_template

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = chat_template._tojson
    env.globals["raise_exception"] = chat_template._raise_exception
    return env.from_string(source).render(**variables)


def _real_templates() -> dict[str, str]:
    folder = Path(__import__("bestiary.core.sources", fromlist=["x"]).__file__).parent / "chat_templates"
    found = {p.name: p.read_text() for p in sorted(folder.glob("*.jinja"))}
    try:  # Llama 4's template: tools, namespaces, tojson, loop controls
        from transformers.models.llama4 import processing_llama4

        found["llama4"] = processing_llama4.chat_template
    except (ImportError, AttributeError):
        pass
    found["chatml"] = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                       " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'"
                       " }}{% endif %}")
    return found


@pytest.mark.parametrize("name", sorted(_real_templates()))
def test_real_templates_render_as_before(name):
    source = _real_templates()[name]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    chats = [CHAT, [{"role": "system", "content": "s"}, *CHAT, {"role": "assistant", "content": "yo"},
                    {"role": "user", "content": "q " * 5000}],
             [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 500 + CHAT]
    for messages in chats:
        for tool_list in (None, tools):
            special = {"bos_token": "<s>", "eos_token": "</s>"}
            expected = _plain_render(source, messages=messages, tools=tool_list, documents=None,
                                     add_generation_prompt=True, **special)
            assert render_chat(source, messages, True, special, tool_list) == expected
