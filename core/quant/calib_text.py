"""Built-in calibration texts for the quantizers, shipped as package data (core/quant/data/).

`data/weight_calibration.txt` (the weight quantizers, core.convert.quantize_calibrated): written for
bestiary: a mix of narrative prose, a short story and a poem, encyclopedia-style science and
history, worked maths, a news report, how-to instructions and recipes, letters and emails, a
product review, FAQs, terms of use, a travel guide, a forum thread, dialogue, numbers and tables,
code in a few languages (some with explanations), chat-style exchanges, and technical
documentation with source code (a manual page, a REST API reference, a C header and its code, a
Makefile, a Go package with its test, a backup shell script, a configuration-format
specification, a README and changelog, a Java class, and a question-and-answer post about a Rust
compiler error), so the layers see the kinds of input a small general model meets. It is
independent of the evaluation text of tests/quant/test_quant_smollm2.py (Python standard-library
docstrings). The KV cache scales' shorter text (`data/kv_calibration.txt`,
core.convert.kv_scales.BUILTIN_TEXT) is appended.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def builtin_text(name: str) -> str:
    """The UTF-8 text of data file `name` in this package's data/ folder."""
    return (files("bestiary.core.quant") / "data" / name).read_text(encoding="utf-8")


def __getattr__(name: str) -> str:
    """`WEIGHT_CALIB_TEXT`: the weight text, a newline, then the KV text (read on first use)."""
    if name == "WEIGHT_CALIB_TEXT":
        return builtin_text("weight_calibration.txt") + "\n" + builtin_text("kv_calibration.txt")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
