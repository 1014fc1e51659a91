"""Text deltas of one generated sequence, with stop strings matched on the text.

A stop string ends the output wherever the text contains it, however the model tokenized
it (the id-level `stop_words` match one tokenization only). The text handed out is cut
before the first stop string; while generation runs, a tail of the text that is still a
proper prefix of a stop string is held back (it may become one with the next token).
"""

from __future__ import annotations

from bestiary.core.runtime.tokenizer import StreamDecoder, Tokenizer


def first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index in `text` of the earliest stop string starting at or after `start`, or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextDeltas:
    """New text per batch of tokens: stop tokens left out, UTF-8 characters kept whole, cut at
    the first stop string (then `stopped` is True and nothing more comes)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: set[int], stop_strings: list[str] | None = None) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.stop_ids = stop_ids
        self.stop_strings = list(stop_strings or [])
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    @property
    def output(self) -> str:
        """The text handed out so far (the whole output once the last push was final or stopped)."""
        return self.text[: self.sent]

    def push(self, tokens: list[int], final: bool) -> str:
        """New text of `tokens`; at the end, whatever an incomplete character held back too."""
        if self.stopped:
            return ""
        self.text += "".join(self.decoder.push(t) for t in tokens if t not in self.stop_ids)
        if final and self.decoder.ids:
            whole = self.decoder.tokenizer.decode(self.decoder.ids)
            if len(whole) > len(self.decoder.emitted) and whole.startswith(self.decoder.emitted):
                self.text += whole[len(self.decoder.emitted):]
                self.decoder.emitted = whole
        end = len(self.text)
        if self.stop_strings:
            hit = first_stop(self.text, self.stop_strings, self.sent)
            if hit is not None:
                end, self.stopped = hit, True
            elif not final:
                end -= held_back(self.text[self.sent:], self.stop_strings)
        out = self.text[self.sent : end]
        self.sent = max(end, self.sent)
        return out
