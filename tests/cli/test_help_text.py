"""Every flag of every `bestiary` command has help text that shows its default; required flags read as
required.

The walk covers the whole parser tree as make_parser builds it (every subparser, nested ones too, every
action), so a flag added later is checked without touching this file:

- every argument and every command has help text (argparse.SUPPRESS, a deliberately hidden flag, passes);
- an optional flag whose default is a value (not None, False, "" or an empty list: core.cli.parsing's
  worth_showing) shows it in --help as `default: VALUE` or `default VALUE` (a list: its items, or its repr);
- no help says `None`: a flag that defaults to None says what leaving it out means instead;
- a flag the parser requires appears in the usage line outside brackets and its help says "required".
"""

from __future__ import annotations

import argparse
import re

import pytest

from bestiary.core.cli.main import make_parser
from bestiary.core.cli.parsing import FlagHelpFormatter, OneLineParser, shown_default, worth_showing

SKIPPED = (argparse._HelpAction, argparse._SubParsersAction)


def parsers(parser: argparse.ArgumentParser, name: str = "bestiary") -> list[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) for `parser` and every subparser below it, depth first."""
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += parsers(sub, f"{name} {sub_name}")
    return found


def action_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry of `parser --help`, whitespace collapsed."""
    return " ".join(parser._get_formatter()._format_action(action).split())


def shows_default(text: str, default: object) -> bool:
    """Whether `text` says `default: VALUE` (or `default VALUE`) for this default."""
    forms = {str(default), shown_default(default)}
    if isinstance(default, float):
        forms.add(f"{default:g}")
    return any(re.search(r"default:?\s+" + re.escape(form) + r"(?![\w.])", text) for form in forms)


def help_problems(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with the help of `parser`'s own actions (not its subparsers')."""
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            problems += [f"{name} {choice.dest}: command without help" for choice in action._choices_actions
                         if not (choice.help or "").strip()]
        if isinstance(action, SKIPPED) or action.help == argparse.SUPPRESS:
            continue
        flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
        if not (action.help or "").strip():
            problems.append(f"{flag}: no help text")
            continue
        text = action_help(parser, action)
        if re.search(r"\bNone\b", text):
            problems.append(f"{flag}: help says None ({text!r}); say what leaving the flag out means")
        if action.option_strings and worth_showing(action) and not shows_default(text, action.default):
            problems.append(f"{flag}: default {action.default!r} not shown in {text!r}")
        if action.option_strings and action.required and "required" not in text.lower():
            problems.append(f"{flag}: required, and its help does not say so")
    return problems


def unbracketed(usage: str, flag: str) -> bool:
    """Whether `flag` appears in `usage` at least once outside [...] (required), as a whole flag."""
    for match in re.finditer(re.escape(flag) + r"(?![\w-])", usage):
        before = usage[: match.start()]
        if before.count("[") == before.count("]"):
            return True
    return False


ALL = parsers(make_parser())


def test_the_walk_sees_every_command():
    names = {name for name, _ in ALL}
    assert {"bestiary convert", "bestiary run", "bestiary serve", "bestiary bench", "bestiary demo"} <= names
    assert sum(len(p._actions) for _, p in ALL) > 150


@pytest.mark.parametrize(("name", "parser"), ALL, ids=[name for name, _ in ALL])
def test_every_flag_has_help_and_shows_its_default(name, parser):
    assert help_problems(name, parser) == []


@pytest.mark.parametrize(("name", "parser"), ALL, ids=[name for name, _ in ALL])
def test_required_flags_are_unbracketed_in_usage(name, parser):
    usage = " ".join(parser.format_usage().split())
    required = [flag for a in parser._actions if a.required and a.option_strings for flag in a.option_strings[:1]]
    assert [flag for flag in required if not unbracketed(usage, flag)] == [], usage


def test_convert_usage_shows_its_required_flags_per_mode():
    """--model_dir / --output_dir are required except in one mode each (--lora_dir, --dry_run), so argparse
    cannot require them: convert's usage names each mode with its required flags, out of brackets."""
    convert = dict(ALL)["bestiary convert"]
    lines = [" ".join(line.split()) for line in convert.format_usage().splitlines()]
    assert len(lines) == 3
    assert all(unbracketed(lines[0], flag) for flag in ("--model_dir", "--output_dir"))
    assert all(unbracketed(lines[1], flag) for flag in ("--model_dir", "--dry_run"))
    assert all(unbracketed(lines[2], flag) for flag in ("--lora_dir", "--output_dir"))
    assert not unbracketed(lines[2], "--model_dir")
    text = convert.format_help()
    for flag in ("--model_dir", "--output_dir"):
        assert "Required" in action_help(convert, next(a for a in convert._actions if flag in a.option_strings))
    assert "--dry_run" in text and "--report" in text


def toy() -> OneLineParser:
    parser = OneLineParser(prog="toy")
    parser.add_argument("--count", type=int, default=3, help="How many.")
    parser.add_argument("--names", nargs="+", default=["a", "b"], help="Which.")
    parser.add_argument("--path", required=True, help="Where.")
    parser.add_argument("--off", action="store_true", help="A switch.")
    parser.add_argument("--maybe", default=None, help="Optional (default: the other one).")
    parser.add_argument("--rate", type=float, default=0.5, help="Rate (default: %(default)s).")
    return parser


def test_the_formatter_adds_defaults_and_required():
    parser = toy()
    assert isinstance(parser._get_formatter(), FlagHelpFormatter)
    text = " ".join(parser.format_help().split())
    assert "How many. (default: 3)" in text and "Which. (default: a b)" in text
    assert "Where. (required)" in text and "A switch." in text and "(default: False)" not in text
    assert "(default: the other one)" in text and "None" not in text
    assert "Rate (default: 0.5)." in text and text.count("default: 0.5") == 1
    assert help_problems("toy", parser) == []
    assert unbracketed(parser.format_usage(), "--path") and not unbracketed(parser.format_usage(), "--count")


def test_the_checks_catch_a_flag_without_help_or_default():
    """The walk's checks can fail: a flag without help, a default its help hides, a help saying None."""
    parser = toy()
    parser.add_argument("--bare", type=int, default=None)
    parser.add_argument("--hidden_default", default=7, help="Says the default is something else (default: 8).")
    parser.add_argument("--says_none", default=None, help="Sets it (default: None).")
    problems = help_problems("toy", parser)
    assert [p.split(":")[0] for p in problems] == ["toy --bare", "toy --hidden_default", "toy --says_none"]
    plain = argparse.ArgumentParser(prog="plain")  # argparse's own formatter: neither default nor "required"
    plain.add_argument("--count", type=int, default=3, help="How many.")
    plain.add_argument("--path", required=True, help="Where.")
    assert len(help_problems("plain", plain)) == 2
