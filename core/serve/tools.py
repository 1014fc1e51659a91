"""How a chat request's tools reach the model, and the grammar that holds a required call.

The template: a chat template that reads `tools` (Qwen's, Llama 3.1's, Mistral's, ...) renders them
itself, with the assistant's earlier `tool_calls` and the `tool` messages. One that does not
(SmolLM2's) gets the fallback: the tools listed in a system message (the original system text
first) that shows the call format of the server's parser (core.serve.tool_calls), earlier calls
written into their assistant message in that format, and each tool result as a user message
`<tool_response>\\n...\\n</tool_response>`.

The output, by tool_choice:

    none       no tools shown, nothing parsed (response_format, if any, holds)
    auto       the model is free; its text is parsed for calls (with response_format json_*: the
               answer is either calls or JSON that validates, `start: answer | calls`)
    required   constrained to one or more calls (one with parallel_tool_calls false) of any tool
    named      constrained to calls of that function

A constrained call is a Lark grammar (llguidance's) whose arguments are `%json {parameters}`,
written as the parser reads it: {"name": "N", "arguments": {...}} (llama3: "parameters"), in
<tool_call> blocks (hermes), separated by "; " (llama3), or in one [...] array (mistral, without its
[TOOL_CALLS] special token: the parser takes the array alone). Whitespace inside the arguments is
JSON's single form (", " and ": "), as GuidedConfig's default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.chat_template import template_variables
from bestiary.core.runtime.guided import GuidedConfig
from bestiary.core.serve.protocol import ChatCompletionRequest, ChatMessage, Tool
from bestiary.core.serve.tool_calls import HERMES_CLOSE, HERMES_OPEN, detect_parser, format_calls

WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
CALL_FORMATS = {
    "hermes": f'{HERMES_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{HERMES_CLOSE}',
    "llama3": '{"name": <function-name>, "parameters": <args-json-object>}',
    "mistral": '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]',
}


@dataclass
class ToolPlan:
    """What a chat request's tools change: the template's input, how the output is parsed and held."""

    messages: list[dict]
    tools: list[dict] | None  # the template's `tools` variable (None: not shown, or shown by the fallback)
    parser: str | None  # the output's tool call format (None: not parsed)
    guided: GuidedConfig | None  # the output's constraint (response_format's, the calls', or both)


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (reads its `tools` variable); False for one that does not
    compile (rendering it then answers with the error, as without tools)."""
    try:
        return bool(template) and "tools" in template_variables(str(template))
    except BestiaryError:
        return False


def resolve_parser(flag: str, template: str | None) -> str:
    """--tool_parser, or (auto) the format the template shows; the fallback prompt's (hermes) without one."""
    if flag != "auto":
        return flag
    return detect_parser(template) if template_reads_tools(template) else "hermes"


def plan_tools(body: ChatCompletionRequest, template: str | None, flag: str) -> ToolPlan:
    """The template's messages and tools, the output's parser and constraint, for `body` under `template`."""
    native = template_reads_tools(template)
    parser = resolve_parser(flag, template)
    mode = body.tool_mode
    answer = body.guided()
    messages = template_messages(body.messages, template, flag)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if mode != "none" else None
    if tools and not native:
        messages = with_tool_prompt(messages, tools, parser)
    if mode == "none":
        return ToolPlan(messages, None, None, answer)
    guided = answer
    if mode in ("required", "named"):
        guided = GuidedConfig(grammar=calls_grammar(chosen(body), parser, body.parallel_tool_calls))
    elif answer is not None and answer.kind in ("json_schema", "json_object"):
        schema = answer.json_schema if answer.kind == "json_schema" else {"type": "object"}
        guided = GuidedConfig(grammar=calls_grammar(body.tools or [], parser, body.parallel_tool_calls, schema))
    return ToolPlan(messages, tools if native else None, parser, guided)


def template_messages(messages: list[ChatMessage], template: str | None, flag: str) -> list[dict]:
    """The conversation as `template` sees it: as sent (with tool_calls and tool_call_id) to one that reads
    `tools`, else with calls and tool results written as text (fallback_messages)."""
    if template_reads_tools(template):
        return [m.as_template_message() for m in messages]
    return fallback_messages(messages, resolve_parser(flag, template))


def chosen(body: ChatCompletionRequest) -> list[Tool]:
    """The tools a call may name: all (required), or the one tool_choice names."""
    tools = body.tools or []
    choice = body.tool_choice
    if isinstance(choice, str) or choice is None:
        return tools
    return [t for t in tools if t.function.name == choice.function.name]


def fallback_messages(messages: list[ChatMessage], parser: str) -> list[dict]:
    """Messages for a template that cannot render tool calls: calls as text in their assistant message,
    consecutive tool results as one user message of <tool_response> blocks."""
    out: list[dict] = []
    after_tool = False  # the last message out holds tool results
    for m in messages:
        message: dict = {"role": m.role, "content": m.text}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            calls = format_calls([(c.function.name, c.as_template_call()["function"]["arguments"])
                                  for c in m.tool_calls], parser)
            message["content"] = f"{m.text}\n{calls}" if m.text else calls
        if m.role == "tool":
            response = f"<tool_response>\n{m.text}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + response
                continue
            message = {"role": "user", "content": response}
        after_tool = m.role == "tool"
        out.append(message)
    return out


def tool_prompt(tools: list[dict], parser: str) -> str:
    """The fallback's description of the tools and of how to call one."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query. The functions "
            f"(their JSON Schemas) are:\n<tools>\n{listed}\n</tools>\n\nTo call a function, reply with its name "
            f"and arguments as JSON in this format:\n{CALL_FORMATS[parser]}")


def with_tool_prompt(messages: list[dict], tools: list[dict], parser: str) -> list[dict]:
    """`messages` with the tool prompt after the system message's text (a new system message if none)."""
    prompt = tool_prompt(tools, parser)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}" if messages[0]["content"]
                     else prompt)
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def schema_text(schema: object) -> str:
    """A schema as `%json` takes it: with GuidedConfig's default whitespace, and "=" written \\u003d (the same
    JSON; GuidedConfig reads a grammar holding "::=" as GBNF, and "=" only occurs inside JSON strings)."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": WHITESPACE}
    return json.dumps(schema, ensure_ascii=False).replace("=", "\\u003d")


def calls_grammar(tools: list[Tool], parser: str, parallel: bool, answer: object = None) -> str:
    """The Lark grammar of calls of `tools` in `parser`'s format: one, or (parallel) one or more;
    with `answer` (a JSON Schema), the output may instead be JSON that validates against it."""
    key = "parameters" if parser == "llama3" else "arguments"
    lines = []
    for i, tool in enumerate(tools):
        head = json.dumps(f'{{"name": {json.dumps(tool.function.name)}, "{key}": ')
        lines.append(f"fn_{i}: {head} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {schema_text(tool.function.parameters or NO_ARGUMENTS)}")
    one = " | ".join(f"fn_{i}" for i in range(len(tools)))
    if parser == "hermes":
        lines.append(f"call: {json.dumps(HERMES_OPEN + chr(10))} ({one}) {json.dumps(chr(10) + HERMES_CLOSE)}")
        calls = 'call ("\\n" call)* "\\n"?' if parallel else 'call "\\n"?'  # a model may end its line, then stop
    else:
        lines.append(f"call: {one}")
        separator = '"; "' if parser == "llama3" else '", "'
        calls = f"call ({separator} call)*" if parallel else "call"
        calls = f'"[" {calls} "]"' if parser == "mistral" else calls
    lines.insert(0, f"calls: {calls}")
    if answer is None:
        return "start: calls\n" + "\n".join(lines) + "\n"
    return f"start: calls | answer\nanswer: %json {schema_text(answer)}\n" + "\n".join(lines) + "\n"
