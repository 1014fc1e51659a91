"""Tool call parsers (core.serve.tool_calls) and the tools' template input and grammar (core.serve.tools), on
strings: the three formats whole, and grown a character at a time (the streamed deltas fold to the
non-streamed message, each delta in OpenAI's shape); the fallback prompt and the native template path."""

from __future__ import annotations

import json

import pytest

from bestiary.core.runtime.chat_template import render_chat, template_variables
from bestiary.core.serve.protocol import ChatCompletionRequest
from bestiary.core.serve.tool_calls import (
    ParsedCall,
    ToolCallDeltas,
    detect_parser,
    format_calls,
    parse,
    value_end,
)
from bestiary.core.serve.tools import (
    calls_grammar,
    plan_tools,
    resolve_parser,
    schema_text,
    template_reads_tools,
)

WEATHER = ParsedCall("get_weather", '{"city": "Paris \\"x\\" }"}')
CASES = [  # (parser, text, content, calls)
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"x\\" }"}}\n'
               '</tool_call>\n<tool_call>\n{"arguments": {"a": [1, 2]}, "name": "f"}\n</tool_call>',
     "Let me check.\n", [WEATHER, ParsedCall("f", '{"a": [1, 2]}')]),
    ("hermes", "plain text with < and <tool but no call", "plain text with < and <tool but no call", []),
    ("hermes", "<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
    ("hermes", '<tool_call>{"name": "now", "arguments": {}}', "", [ParsedCall("now", "{}")]),  # no closing tag
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "g", '
               '"parameters": {}}', "", [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("g", "{}")]),
    ("llama3", ' {"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [ParsedCall("get_weather", '{"city": "Paris"}')]),
    ("llama3", '{"city": "Paris"}', '{"city": "Paris"}', []),  # a JSON answer, not a call
    ("llama3", "The weather is fine.", "The weather is fine.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "g", '
                '"arguments": {"x": 1}}]', "", [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                 ParsedCall("g", '{"x": 1}')]),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [ParsedCall("get_weather", '{"city": "Paris"}')]),  # the special token decoded away
    ("mistral", "[1] is a citation", "[1] is a citation", []),
]


def fold(parser: str, text: str) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """(content, [(name, arguments)], deltas) of `text` streamed a character at a time."""
    stream, deltas = ToolCallDeltas(parser), []
    for ch in text:
        deltas += stream.push(ch)
    deltas += stream.push("", final=True)
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], ["", ""])
            call[0] += tc["function"].get("name", "")
            call[1] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()], deltas


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse_whole_and_streamed(parser, text, content, calls):
    parsed = parse(text, parser)
    assert (parsed.content, parsed.calls) == (content, calls)
    streamed_content, streamed_calls, deltas = fold(parser, text)
    assert (streamed_content, streamed_calls) == (content, [(c.name, c.arguments) for c in calls])
    firsts = [tc for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    assert len(firsts) == len(calls)
    for i, first in enumerate(firsts):  # OpenAI's first delta of a call: index, id, type, name, arguments ""
        assert first["index"] == i and first["id"].startswith("call_") and len(first["id"]) == 29
        assert first["type"] == "function" and first["function"]["arguments"] == ""
    assert all(set(d) in ({"content"}, {"tool_calls"}) for d in deltas)


def test_arguments_stream_as_they_grow():
    """Once a call's name is complete, its arguments come in fragments, before the call is finished."""
    stream = ToolCallDeltas("hermes", call_id=lambda: "call_x")
    assert stream.push("Sure. <tool") == [{"content": "Sure. "}]  # a possible marker is held back
    assert stream.push('_call>\n{"name": "get_w') == []  # the name is not complete
    assert stream.push('eather", "arguments": {"ci') == [
        {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert stream.push('ty": "Paris"}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}]
    assert stream.push("", final=True) == [] and stream.called


def test_a_call_cut_short_keeps_what_it_has():
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse(cut, "hermes").calls == [ParsedCall("get_weather", '{"city": "Pa')]
    assert parse('<tool_call>\n{"name":', "hermes").content == '<tool_call>\n{"name":'  # not a call: kept as text
    after = parse('<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>\n{"name":', "hermes")
    assert (after.content, after.calls) == ("", [ParsedCall("now", "{}")])  # max_tokens cut a second call: dropped


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_format_calls_parses_back(parser):
    calls = [("get_weather", {"city": "Zürich"}), ("now", {})]
    assert parse(format_calls(calls, parser), parser).calls == [
        ParsedCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


def test_value_end():
    assert value_end('{"a": "}"} x', 0) == 10
    assert value_end('[1, {"b": []}]', 0) == 14
    assert value_end('{"a": 1', 0) is None
    assert value_end('"x\\"y" z', 0) == 6
    assert value_end("123, 4", 0) == 3 and value_end("123", 0) is None


def test_detect_parser_from_the_template_text():
    assert detect_parser("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert detect_parser("{{- '<|python_tag|>' }} {\"name\": function name, \"parameters\": ...}") == "llama3"
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser(None) == "hermes"
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert "tools" not in template_variables(plain)
    assert resolve_parser("auto", plain + "[TOOL_CALLS]") == "hermes"  # no tools in the template: the fallback's
    assert resolve_parser("llama3", plain) == "llama3"
    assert not template_reads_tools("{{ tools }") and template_reads_tools("{{ tools }}")  # broken: rendering says so


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather ::= of a {city}",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "a = b"}}}}}]
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
NATIVE = ("{% if tools %}TOOLS {% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
          "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% for c in m.tool_calls or [] %}"
          "CALL {{ c.function.name }} {{ c.function.arguments | tojson }} {{ c.function.arguments.city }}"
          "{% endfor %}\n{% endfor %}")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": TOOLS, **fields})


def test_fallback_prompt_for_a_template_without_tools():
    plan = plan_tools(request(), PLAIN, "auto")
    assert (plan.parser, plan.tools, plan.guided) == ("hermes", None, None)  # auto: free, parsed
    text = render_chat(PLAIN, plan.messages, True)
    assert text.startswith("<|system|># Tools") and '"name": "get_weather"' in text and "<tool_call>" in text
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|user|><tool_response>\n{"temp": 21}\n</tool_response>' in text
    none = plan_tools(request(tool_choice="none"), PLAIN, "auto")
    assert none.parser is None and "# Tools" not in render_chat(PLAIN, none.messages, True)


def test_native_template_gets_tools_and_calls_with_object_arguments():
    plan = plan_tools(request(tool_choice="required"), NATIVE, "auto")
    text = render_chat(NATIVE, plan.messages, True, tools=plan.tools)
    assert text.startswith('TOOLS {"type": "function", "function": {"name": "get_weather"')
    assert 'CALL get_weather {"city": "Paris"} Paris' in text  # arguments as an object, as transformers passes
    assert plan.guided is not None and plan.guided.grammar is not None and "# Tools" not in text


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_calls_grammar_shape(parser):
    tools = request().tools
    one = calls_grammar(tools, parser, parallel=False)
    many = calls_grammar(tools, parser, parallel=True, answer={"type": "object"})
    assert one.startswith("start: calls\ncalls: ") and "::=" not in one  # "=" in a schema never reads as GBNF
    assert many.startswith("start: calls | answer\n") and "*" in many.splitlines()[2]
    key = "parameters" if parser == "llama3" else "arguments"
    assert json.dumps(f'{{"name": "get_weather", "{key}": ') in one
    assert json.loads(schema_text({"a": "x = y"}).replace("\\u003d", "=")) == {
        "a": "x = y", "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def test_tool_parser_flag():
    from bestiary.core.cli.main import make_parser

    parser = make_parser()
    assert parser.parse_args(["serve", "--engine_dir", "e"]).tool_parser == "auto"
    assert parser.parse_args(["serve", "--engine_dir", "e", "--tool_parser", "mistral"]).tool_parser == "mistral"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--engine_dir", "e", "--tool_parser", "xml"])
