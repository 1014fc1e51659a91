"""--speculative / --num_draft_tokens / --draft_engine_dir / --fixed_draft_tokens: the flags of speculative
decoding (core.runtime.speculative) shared by run, serve and bench."""

from __future__ import annotations

import argparse

from bestiary.core.cli.parsing import path_arg
from bestiary.core.format.errors import BestiaryError


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    """The four flags, defaults and help from SpeculativeConfig."""
    from bestiary.core.runtime.speculative_config import SpeculativeConfig

    f = SpeculativeConfig.model_fields
    g = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    g.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="Draft tokens by prompt lookup (ngram) or with a draft engine (draft); verified in one step "
                        "(default: off).")
    g.add_argument("--num_draft_tokens", type=int, default=None, metavar="K",
                   help=f"{f['num_draft_tokens'].description} (default: {f['num_draft_tokens'].default})")
    g.add_argument("--draft_engine_dir", type=path_arg, default=None, metavar="DIR",
                   help=f["draft_engine_dir"].description)
    g.add_argument("--fixed_draft_tokens", action="store_true", default=None,
                   help="Draft num_draft_tokens tokens on every step (default: a k per sequence, 0 to K, from the "
                        "measured acceptance and step costs; docs/speculative.md).")


def speculative_from_args(args: argparse.Namespace):
    """The SpeculativeConfig the flags ask for, or None; a flag without --speculative, or a bad
    value, is a one-line error naming the flag."""
    from bestiary.core.runtime.speculative_config import speculative_config

    if args.speculative is None:
        given = [f"--{n}" for n in ("num_draft_tokens", "draft_engine_dir", "fixed_draft_tokens")
                 if getattr(args, n, None) is not None]
        if given:
            raise BestiaryError(f"{given[0]} needs --speculative ngram|draft")
        return None
    fields = {"method": args.speculative, "draft_engine_dir": args.draft_engine_dir}
    if args.num_draft_tokens is not None:
        fields["num_draft_tokens"] = args.num_draft_tokens
    if getattr(args, "fixed_draft_tokens", None):
        fields["adaptive"] = False
    return speculative_config(fields, label=lambda field: f"--{field or 'speculative'}")
