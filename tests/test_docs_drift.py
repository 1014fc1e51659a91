"""The docs say what the Makefile and the parsers do.

- README.md and docs/quickstart.md install the extras the Makefile installs (they said `.[test]` while
  `make install` ran `.[test,serve,lint]`), and quote `make test`'s pytest command as the Makefile runs it
  (quickstart called it "the whole test suite"; it leaves out the tests marked slow).
- docs/cli.md has a section per `bestiary` command; each section's usage block names exactly the
  command's flags, and the section mentions every flag (its convert usage lacked --dry_run / --report).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from bestiary.core.cli.main import COMMAND_MODULES, make_parser

ROOT = Path(__file__).resolve().parent.parent
FLAG = r"--[A-Za-z][\w-]*"


def makefile() -> str:
    return (ROOT / "Makefile").read_text()


def install_recipe() -> str:
    """The Makefile's recipe that installs the project for every target (`$(INSTALLED):`), not test-eval's extra."""
    recipe = re.search(r"^\$\(INSTALLED\):.*\n(?:\t.*\n)*", makefile(), re.M)
    assert recipe, "Makefile: no $(INSTALLED) target"
    return recipe.group(0)


def extras(text: str) -> list[set[str]]:
    """The extras of every `pip install ... -e '.[a,b]'` (the Makefile: `$(PIP) install`) in `text`, one set each."""
    return [set(m.split(",")) for m in re.findall(r"(?:pip|\$\(PIP\)) install[^\n`]*?-e '?\.\[([\w,-]+)\]'?", text)]


def make_test_command() -> str:
    """`make test`'s pytest command as the docs write it: python for $(PYTHON), TEST_WORKERS's default."""
    recipe = re.search(r"^test:.*\n(?:\t.*\n)*", makefile(), re.M)
    assert recipe, "Makefile: no test target"
    line = next(line.strip() for line in recipe.group(0).splitlines() if "pytest" in line)
    workers = re.search(r"^TEST_WORKERS \?= (\S+)", makefile(), re.M)
    assert workers, "Makefile: no TEST_WORKERS default"
    return line.replace("$(PYTHON)", "python").replace("$(TEST_WORKERS)", workers.group(1))


def test_the_makefile_installs_extras():
    assert extras(install_recipe()) and {"test", "serve"} <= extras(install_recipe())[0]


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_install_lines_match_the_makefile(doc):
    (make_extras,) = extras(install_recipe())
    found = extras((ROOT / doc).read_text())
    assert make_extras in found, f"{doc}: installs {found}, the Makefile {make_extras}"


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_make_test_is_described_as_it_runs(doc):
    text = (ROOT / doc).read_text()
    assert make_test_command() in text
    assert '-m "not slow"' in make_test_command()
    assert not re.search(r"make test\s+# .*whole test suite", text)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def section(name: str) -> str:
    text = (ROOT / "docs" / "cli.md").read_text()
    match = re.search(r"^## `bestiary " + re.escape(name) + r"`\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/cli.md: no section ## `bestiary {name}`"
    return match.group(1)


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if not isinstance(a, argparse._HelpAction)
            for s in a.option_strings if s.startswith("--")}


def test_every_command_has_a_section_and_is_listed():
    top = (ROOT / "docs" / "cli.md").read_text().split("\n## ")[0]
    for name in COMMAND_MODULES:
        section(name)
        assert re.search(rf"^    {re.escape(name)}\s", top, re.M), f"docs/cli.md: {name} not in the command list"


@pytest.mark.parametrize("name", list(COMMAND_MODULES))
def test_cli_md_mentions_every_flag(name):
    text = section(name)
    missing = sorted(f for f in flags(subcommands()[name]) if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert missing == [], f"docs/cli.md, bestiary {name}: flags not mentioned: {missing}"


@pytest.mark.parametrize("name", list(COMMAND_MODULES))
def test_cli_md_usage_is_the_parsers(name):
    """The usage block names the flags the parser's usage names (wrapping aside): regenerate it with
    `COLUMNS=100 bestiary NAME --help | sed '/^$/q'` when a flag is added."""
    usage = re.search(r"```text\n(usage: bestiary " + re.escape(name) + r"\b.*?)```", section(name), re.S)
    assert usage, f"docs/cli.md, bestiary {name}: no usage block"
    parser_usage = subcommands()[name].format_usage()
    assert set(re.findall(FLAG, usage.group(1))) == set(re.findall(FLAG, parser_usage)), parser_usage
