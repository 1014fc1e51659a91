"""Tool calls in a model's text: parsed into OpenAI's `tool_calls`, whole or as a stream grows.

Three formats, those of the zoo's chat templates (`detect_parser` picks one from a template's text;
`bestiary serve --tool_parser` overrides it):

    hermes   <tool_call>{"name": N, "arguments": {...}}</tool_call>   (Hermes, Qwen; the fallback prompt's)
             one block per call, text before them is content
    llama3   {"name": N, "parameters": {...}}                         (Llama 3.1 / 3.2 JSON tool calling)
             the whole answer, after an optional <|python_tag|>; several calls separated by ";"
    mistral  [TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]       (Mistral v0.3)

`<|python_tag|>` and `[TOOL_CALLS]` are special tokens, which the decoded text usually lacks: both
parsers take the answer with or without them. "arguments" and "parameters" are read alike.

A parse is a snapshot of the text so far: `parse(text, parser, final=False)` keeps back what may
still become a call (a partial `<tool_call` marker, an unfinished call head), so each snapshot of a
growing text extends the previous one, and `ToolCallDeltas` streams their differences as OpenAI's
chunk deltas. A call's arguments are the model's own text of the arguments value, streamed as it
grows once the call's name is complete; the streamed deltas fold to the non-streamed message.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_TAG = "<|python_tag|>", "[TOOL_CALLS]"
_STRING = r'"(?:[^"\\]|\\.)*"'
# the head of a call object, up to its arguments value: {"name": "N", "arguments": (or "parameters")
_SCALAR = re.compile(r"[^,\]}\s]*")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ParsedCall:
    """One call: the function's name and its arguments' JSON text (possibly partial while streaming)."""

    name: str
    arguments: str


@dataclass
class Parsed:
    """A text split into content (outside the calls) and calls."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def detect_parser(template: str | None) -> str:
    """The format a chat template's text shows: its call markers; hermes when it shows none."""
    text = template or ""
    if MISTRAL_TAG in text:
        return "mistral"
    if PYTHON_TAG in text or '"parameters"' in text:
        return "llama3"
    return "hermes"


def new_call_id() -> str:
    """An OpenAI-style call id: call_ and 24 random alphanumerics."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins at text[start], None if the text ends first.

    Objects and arrays by bracket depth outside strings; a string to its closing quote; a bare
    scalar (number, true, false, null) to the next delimiter.
    """
    if start >= len(text):
        return None
    if text[start] not in '{["':
        scalar = _SCALAR.match(text, start)
        end = scalar.end() if scalar else start
        return end if end < len(text) else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if text[start] == '"':
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_of(body: str, final: bool) -> ParsedCall | None:
    """The call a call object's text holds (partial arguments while the text grows); None: not (yet) a call.

    With its name first, the arguments are their own text, as far as it goes; otherwise (keys in another
    order) a complete object is read whole and its arguments written back as JSON.
    """
    text = body.lstrip()
    head = _HEAD.match(text)
    if head is not None:
        start = head.end()
        end = value_end(text, start)
        arguments = text[start:end] if end is not None else text[start:]
        return ParsedCall(json.loads(head.group(1)), arguments)
    end = value_end(text, 0) if text.startswith("{") else None
    if end is None and not final:
        return None
    try:
        obj = json.loads(text[:end] if end is not None else text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    value = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker` (kept until they are not)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_hermes(text: str, final: bool = True) -> Parsed:
    """<tool_call>{call}</tool_call> blocks; text outside them is content (after a call, only text that is not
    whitespace). A block whose text is not a call stays in the content, marker included."""
    out, pos = Parsed(), 0
    while True:
        i = text.find(HERMES_OPEN, pos)
        segment = text[pos:] if i < 0 else text[pos:i]
        if i < 0 and not final:
            segment = segment[: len(segment) - _held_back(segment, HERMES_OPEN)]
        if not out.calls or segment.strip():
            out.content += segment
        if i < 0:
            return out
        start = i + len(HERMES_OPEN)
        j = text.find(HERMES_CLOSE, start)
        call = call_of(text[start:] if j < 0 else text[start:j], final or j >= 0)
        if call is None:
            if j < 0 and (not final or out.calls):  # one still coming, or one cut short after calls: dropped
                return out
            out.content += text[i:] if j < 0 else text[i: j + len(HERMES_CLOSE)]
        else:
            out.calls.append(call)
        if j < 0:
            return out
        pos = j + len(HERMES_CLOSE)


def _after_tag(text: str, tag: str, opener: str, final: bool) -> int | None:
    """Where the calls start: past leading whitespace and an optional `tag`, at `opener`; -1: the text is content;
    None: too early to tell (the text so far is whitespace or a prefix of the tag)."""
    stripped = text.lstrip()
    rest = stripped[len(tag):].lstrip() if stripped.startswith(tag) else stripped
    if not rest and not final:
        return None
    if not final and tag.startswith(stripped) and stripped:
        return None
    return len(text) - len(rest) if rest.startswith(opener) else -1


def _objects(text: str, pos: int, separators: str, final: bool) -> tuple[list[ParsedCall], int, bool]:
    """The call objects from text[pos], separated by `separators` characters: (calls, where they end, pending).
    A complete object that is not a call ends them; pending: they end at an object that may still become one."""
    calls: list[ParsedCall] = []
    while pos < len(text) and text[pos] == "{":
        end = value_end(text, pos)
        call = call_of(text[pos:] if end is None else text[pos:end], final or end is not None)
        if call is None:
            return calls, pos, end is None and not final
        calls.append(call)
        if end is None:
            return calls, len(text), False
        pos = end
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
    return calls, pos, False


def parse_llama3(text: str, final: bool = True) -> Parsed:
    """An answer that is one or more {"name", "parameters"} objects (after <|python_tag|>), else content."""
    start = _after_tag(text, PYTHON_TAG, "{", final)
    if start is None:
        return Parsed()
    if start < 0:
        return Parsed(content=text)
    calls, end, pending = _objects(text, start, ";", final)
    if not calls:
        return Parsed() if pending or (end == len(text) and not final) else Parsed(content=text)
    return Parsed(content="" if pending or not text[end:].strip() else text[end:], calls=calls)


def parse_mistral(text: str, final: bool = True) -> Parsed:
    """[TOOL_CALLS] [{call}, ...] (the tag optional), else content."""
    start = _after_tag(text, MISTRAL_TAG, "[", final)
    if start is None:
        return Parsed()
    if start < 0:
        return Parsed(content=text)
    pos = start + 1
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text) and not final:
        return Parsed()
    calls, end, pending = _objects(text, pos, ",", final)
    if not calls:
        return Parsed() if pending or (end == len(text) and not final) else Parsed(content=text)
    rest = text[end:].lstrip().removeprefix("]")
    return Parsed(content="" if pending or not rest.strip() else rest, calls=calls)


PARSE: dict[str, Callable[[str, bool], Parsed]] = {"hermes": parse_hermes, "llama3": parse_llama3,
                                                   "mistral": parse_mistral}


def parse(text: str, parser: str, final: bool = True) -> Parsed:
    """`text` split into content and calls by `parser` (one of PARSERS); final=False: a snapshot of a growing text."""
    return PARSE[parser](text, final)


def format_calls(calls: list[tuple[str, object]], parser: str) -> str:
    """The text a model writes for these (name, arguments) calls in `parser`'s format (parse's inverse): how
    an assistant's earlier calls are shown to a template that cannot render them."""
    key = "parameters" if parser == "llama3" else "arguments"
    objects = [json.dumps({"name": name, key: args}, ensure_ascii=False) for name, args in calls]
    if parser == "hermes":
        return "\n".join(f"{HERMES_OPEN}\n{o}\n{HERMES_CLOSE}" for o in objects)
    if parser == "llama3":
        return "; ".join(objects)
    return f"{MISTRAL_TAG} [{', '.join(objects)}]"


def tool_calls_json(calls: list[ParsedCall], ids: list[str]) -> list[dict]:
    """OpenAI's message.tool_calls of parsed calls."""
    return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c, i in zip(calls, ids)]


class ToolCallDeltas:
    """One streamed choice's chat deltas: content text as it is known not to be a call, then each call as
    OpenAI streams it ({index, id, type, function: {name, arguments: ""}}, then argument fragments)."""

    def __init__(self, parser: str, call_id: Callable[[], str] = new_call_id) -> None:
        self.parser, self.call_id = parser, call_id
        self.text = ""
        self.sent = Parsed()  # what the deltas so far hold
        self.ids: list[str] = []

    def push(self, text: str, final: bool = False) -> list[dict]:
        """The deltas `text` (the next piece of the answer) adds; final: the answer is complete."""
        self.text += text
        now = parse(self.text, self.parser, final)
        deltas: list[dict] = []
        if now.content.startswith(self.sent.content) and len(now.content) > len(self.sent.content):
            deltas.append({"content": now.content[len(self.sent.content):]})
            self.sent.content = now.content
        for index, call in enumerate(now.calls):
            if index == len(self.sent.calls):
                self.ids.append(self.call_id())
                deltas.append({"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                self.sent.calls.append(ParsedCall(call.name, ""))
            sent = self.sent.calls[index]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                fragment = call.arguments[len(sent.arguments):]
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                sent.arguments = call.arguments
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.sent.calls)
