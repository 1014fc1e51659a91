"""ban_digits: a request asking for it never gets a token whose text holds an ASCII digit.

args: {"keep": "01"} allows the digits listed (default: none).
"""

from __future__ import annotations

import torch

from bestiary.plugins import hookimpl

DIGITS = "0123456789"


def ban_digits(args: dict, context):
    """The factory: called once per sequence with the request's args and the engine's context."""
    keep = args.get("keep", "")
    if set(args) - {"keep"}:
        raise ValueError(f"unknown args {sorted(set(args) - {'keep'})}; expected 'keep'")
    if not isinstance(keep, str) or any(c not in DIGITS for c in keep):
        raise ValueError(f"keep {keep!r}: expected a string of digits")
    banned = [i for i, text in enumerate(context.token_strings()) if any(c in DIGITS and c not in keep for c in text)]
    banned_ids = torch.tensor(banned, dtype=torch.int64)  # [B]

    def processor(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 with -inf at every banned id."""
        logits[banned_ids.to(logits.device)] = float("-inf")
        return logits

    return processor


@hookimpl
def bestiary_register_logits_processors(register) -> None:
    register("ban_digits", ban_digits)
