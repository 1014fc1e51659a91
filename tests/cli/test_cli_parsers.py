"""Each `bestiary` command adds its own parser (core.cli.main.command): make_parser walks
COMMAND_MODULES, so the table, the registered handlers and the subparsers must agree."""

from __future__ import annotations

import argparse

from bestiary.core.cli.main import COMMAND_MODULES, COMMANDS, make_parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subparsers of `parser`, in `bestiary --help` order."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_command_has_its_parser_in_the_table_order():
    parsers = subcommands(make_parser())
    assert list(parsers) == list(COMMAND_MODULES)
    assert list(parsers)[:3] == ["convert", "build", "export"] and list(parsers)[-1] == "bench"


def test_the_table_names_the_module_that_registers_each_command():
    make_parser()
    assert set(COMMANDS) == set(COMMAND_MODULES)
    for name, module in COMMAND_MODULES.items():
        assert COMMANDS[name].run.__module__ == f"bestiary.core.cli.{module}", name
        assert COMMANDS[name].add_parser.__module__ == f"bestiary.core.cli.{module}", name


def test_shared_flag_groups_stay_on_their_commands():
    """The speculative flags on run, serve and bench; quantization on convert; sampling groups on run."""
    parsers = subcommands(make_parser())
    for name in ("run", "serve", "bench"):
        assert "--speculative" in parsers[name].format_help(), name
    assert "--use_weight_only" in parsers["convert"].format_help()
    assert "penalties, stopping and beam search" in parsers["run"].format_help()
    assert "--speculative" not in parsers["chat"].format_help()
