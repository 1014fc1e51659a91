"""`bestiary lm-eval ARGS...`: lm-evaluation-harness's own command line, with the model "bestiary" registered.

lm-eval 0.4.9 finds models only through `register_model` at import (no entry points), so its own
`lm_eval` command cannot see bestiary's. This command imports core.bench.lm_eval_model (which
registers "bestiary"), parses ARGS with lm-eval's parser and runs its `cli_evaluate`: every lm-eval
flag and model works, e.g. `bestiary lm-eval --model bestiary --model_args engine_dir=E --tasks T`
(or `--model hf` for the reference run, under the same transformers 5 compatibility alias:
core.bench.lm_eval_compat). Needs the `eval` extra (`pip install 'bestiary[eval]'`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from bestiary.core.cli.main import command
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from bestiary.core.cli.main import SubParsers


def add_lm_eval_parser(sub: SubParsers) -> None:
    """Every argument goes to lm-eval's parser untouched: the subparser has no options of its own
    (prefix_chars "+" so that lm-eval's `--flags`, `--help` included, are not read as bestiary's)."""
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness with the 'bestiary' model (lm-eval's own flags)",
                       prefix_chars="+", add_help=False)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, e.g. --model bestiary ...")


def lm_eval_namespace(argv: list[str]) -> argparse.Namespace:
    """lm-eval's parsed arguments (its parser's checks included), with the "bestiary" model registered."""
    try:
        import bestiary.core.bench.lm_eval_model  # noqa: F401 - registers the model "bestiary"
    except ImportError as err:
        raise BestiaryError(f"bestiary lm-eval needs lm-evaluation-harness ({err}); "
                            "install it with: pip install 'bestiary[eval]'") from None
    from lm_eval.__main__ import check_argument_types, setup_parser

    parser = setup_parser()
    check_argument_types(parser)
    return parser.parse_args(argv)


@command("lm-eval", add_lm_eval_parser)
def cmd_lm_eval(args: argparse.Namespace) -> int:
    namespace = lm_eval_namespace(list(args.lm_eval_args))  # first: it imports lm-eval (core.bench.lm_eval_compat)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate(namespace)
    return 0
