"""What a terminal would show for the bytes a program wrote to a pty: the little of an xterm that rich's
prompt and Live use, for the terminal tests of `bestiary chat`.

Printable characters go at the cursor with the terminal's deferred wrap: a character written in the
last column leaves the cursor there, and the next printable character wraps to the next row first
(so a full-width line followed by the terminal's own echo of "^C" moves the cursor one row down; Live's
redraws count on where the cursor is). Handled: CR, LF, BS, cursor up / down / forward / back / column
(CSI A B C D G), erase in line (CSI K), SGR colours and private modes (ignored). Anything else raises:
the test must see it rather than show a wrong screen. Rows are unbounded (the pty is made taller than
any test's output, so nothing scrolls); wide characters take two columns (rich's cell widths).
"""

from __future__ import annotations

import re

from rich.cells import get_character_cell_size

CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")
IGNORED_C0 = {"\x00", "\x03", "\x07"}  # NUL, a raw ^C (echo without ECHOCTL), the bell


class Screen:
    """Rows of text with a cursor; `feed` it a pty's output (decoded), read `lines()`."""

    def __init__(self, columns: int) -> None:
        self.columns = columns
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0
        self.wrap_pending = False

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            if text[i] == "\x1b":
                m = CSI.match(text, i)
                if m is None:
                    raise ValueError(f"unknown escape sequence {text[i:i + 8]!r}")
                self._csi(m.group(1), m.group(2))
                i = m.end()
                continue
            self._char(text[i])
            i += 1

    def lines(self) -> list[str]:
        """Every row, without its trailing blanks."""
        return ["".join(row).rstrip() for row in self.rows]

    def _goto(self, row: int, col: int) -> None:
        self.row, self.col, self.wrap_pending = max(row, 0), min(max(col, 0), self.columns - 1), False
        while len(self.rows) <= self.row:
            self.rows.append([])

    def _char(self, ch: str) -> None:
        if ch == "\r":
            self._goto(self.row, 0)
        elif ch == "\n":
            self._goto(self.row + 1, self.col)
        elif ch == "\b":
            self._goto(self.row, self.col - 1)
        elif ch in IGNORED_C0:
            pass
        elif ch < " ":
            raise ValueError(f"unexpected control character {ch!r}")
        else:
            self._put(ch)

    def _put(self, ch: str) -> None:
        width = get_character_cell_size(ch)
        if self.wrap_pending or self.col + width > self.columns:
            self._goto(self.row + 1, 0)
        row = self.rows[self.row]
        row.extend(" " * (self.col + width - len(row)))
        row[self.col] = ch
        if width == 2:
            row[self.col + 1] = ""  # the second cell of a wide character
        if self.col + width >= self.columns:
            self.wrap_pending = True  # deferred wrap: the cursor stays in the last column
            self.col = self.columns - 1
        else:
            self.col += width

    def _csi(self, params: str, final: str) -> None:
        if params.startswith("?") or final == "m":  # private modes (cursor shown, bracketed paste), colours
            return
        n = int(params.split(";")[0] or 1) if final != "K" else int(params or 0)
        if final in "ABCD":
            dr, dc = {"A": (-n, 0), "B": (n, 0), "C": (0, n), "D": (0, -n)}[final]
            self._goto(self.row + dr, self.col + dc)
        elif final == "G":
            self._goto(self.row, n - 1)
        elif final == "K":
            row = self.rows[self.row]
            start, end = {0: (self.col, len(row)), 1: (0, self.col + 1), 2: (0, len(row))}[n]
            row[start:end] = [" "] * max(min(end, len(row)) - start, 0)
            self.wrap_pending = False
        else:
            raise ValueError(f"unknown escape sequence ESC[{params}{final}")
