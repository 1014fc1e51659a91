"""A time and size budget for rendering chat templates (core.runtime.chat_template).

A chat template is code from the model's files, run in jinja2's immutable sandbox. The sandbox
stops it from reaching Python's internals, but not from looping for hours or building a text of
4 GB: `range(10**5)` nested twice, `'x' * 4000000000`, `'x'.center(10**10)`. The environment here
(`budget_environment`) checks, before and after every operation a template can run:

  time    every call, filter, operator, attribute / item lookup and for-loop iteration checks the
          render's deadline (`deadline(seconds)`, RENDER_SECONDS by default);
  size    `*`, `**`, `+`, `%` (intercepted operators), `join`, `replace`, format strings and every
          integer argument are checked before they run, so no single step builds a value of more
          than TEXT_BUDGET characters (ITEMS_BUDGET items, INT_BITS_BUDGET bits); every value a step
          returns is checked after it, so is every text jinja2 joins (a set block, a macro's output),
          and `render_budgeted` counts the whole prompt's characters;
  loops   a render runs at most ITERATIONS_BUDGET for-loop iterations in all.

Constant folding is off (`optimized=False`): jinja2 would otherwise evaluate `'x' * 4000000000`
while compiling, outside any check. Crossing a budget raises `TemplateBudgetError`.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateRuntimeError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 5.0  # a real template renders in milliseconds
TEXT_BUDGET = 2**26  # characters of one value and of the whole prompt (64 Mi: ~16M tokens)
ITEMS_BUDGET = 2**22  # items of one list / tuple a template builds
INT_BITS_BUDGET = 2**20  # bits of an integer a template computes
TEMPLATE_BUDGET = 2**18  # characters of the template source (real ones: < 50 KB; compiling 256 Ki takes ~2 s)
ITERATIONS_BUDGET = 2**22  # for-loop iterations of one render (the messages of a conversation, ...)
LOOP_FILTER = "_bestiary_budget_loop"  # wraps every for loop's iterable (`loop_iterations`)

_state = threading.local()  # .deadline: (time.monotonic() the current render must end by, its seconds) or None
_DIGITS = re.compile(r"\d+")


class TemplateBudgetError(TemplateRuntimeError):
    """A chat template ran past its time budget or built a value past its size budget."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Renders in this block (on this thread) must finish within `seconds`."""
    previous = getattr(_state, "deadline", None), getattr(_state, "iterations", 0)
    _state.deadline, _state.iterations = (time.monotonic() + seconds, seconds), 0
    try:
        yield
    finally:
        _state.deadline, _state.iterations = previous


def tick() -> None:
    """TemplateBudgetError when the current render is past its deadline."""
    limit = getattr(_state, "deadline", None)
    if limit is not None and time.monotonic() > limit[0]:
        raise TemplateBudgetError(f"rendering took longer than its time budget of {limit[1]:g} s")


def _too_big(what: str, size: int, budget: int, unit: str = "characters") -> TemplateBudgetError:
    return TemplateBudgetError(f"{what} of {size} {unit} is over the budget of {budget} {unit}")


_TEXTS = (str, bytes)
_ITEMS = (list, tuple, dict, set)
_SIZED = (str, bytes, list, tuple, dict, range)


def checked(value: Any) -> Any:
    """`value`, unless it is a text, collection or integer past the size budget (the checks are
    tuples of types, not unions: they run on every operation of a render)."""
    kind = type(value)
    if kind is str or kind is bytes:
        if len(value) > TEXT_BUDGET:
            raise _too_big("a text", len(value), TEXT_BUDGET)
    elif kind is int:
        if value.bit_length() > INT_BITS_BUDGET:
            raise _too_big("an integer", value.bit_length(), INT_BITS_BUDGET, "bits")
    elif isinstance(value, _ITEMS) and len(value) > ITEMS_BUDGET:
        raise _too_big("a collection", len(value), ITEMS_BUDGET, "items")
    elif isinstance(value, _TEXTS) and len(value) > TEXT_BUDGET:  # str subclasses (Markup)
        raise _too_big("a text", len(value), TEXT_BUDGET)
    return value


def check_format(fmt: str) -> None:
    """A format string ('%10d', '{:>10}') whose widths or precisions stay within the text budget."""
    big = next((int(d) for d in _DIGITS.findall(fmt) if len(d) > 7 and int(d) > TEXT_BUDGET), None)
    if big is not None:
        raise _too_big("a format width", big, TEXT_BUDGET)


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, _SIZED) else None


def _repeat_size(left: Any, right: Any) -> tuple[int, int] | None:
    """(length, count) of `seq * n` / `n * seq`, else None."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(n, int) and _sized(seq) is not None:
            return _sized(seq) or 0, max(n, 0)
    return None


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `left operator right` before it runs when its result would be past a budget."""
    if operator == "+":
        if isinstance(left, _SIZED) and isinstance(right, _SIZED):
            _check_size("a concatenation", len(left) + len(right), left, right)
    elif operator == "*":
        repeat = _repeat_size(left, right)
        if repeat is not None:
            _check_size("a repeated value", repeat[0] * repeat[1], left, right)
        elif _both_ints(left, right) and left.bit_length() + right.bit_length() > INT_BITS_BUDGET:
            raise _too_big("a product", left.bit_length() + right.bit_length(), INT_BITS_BUDGET, "bits")
    elif operator == "**" and _both_ints(left, right) and abs(left) > 1 and right > 0:
        bits = right * abs(left).bit_length()
        if bits > INT_BITS_BUDGET:
            raise _too_big("a power", bits, INT_BITS_BUDGET, "bits")
    elif operator == "%" and isinstance(left, str):
        check_format(left)
        values = right if isinstance(right, tuple | list) else tuple(right.values()) if isinstance(right, dict) else (right,)
        check_sizes(tuple(values), {}, "%")  # '%0*d' % (10**9, 1): the width comes from the arguments


def _check_size(what: str, size: int, left: Any, right: Any) -> None:
    """Refuse a result of `size` characters (a text operand) or items (else) past its budget."""
    text = isinstance(left, _TEXTS) or isinstance(right, _TEXTS)
    budget, unit = (TEXT_BUDGET, "characters") if text else (ITEMS_BUDGET, "items")
    if size > budget:
        raise _too_big(what, size, budget, unit)


def _both_ints(left: Any, right: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))


def check_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call that would build a value past the budget: an integer argument past the text
    budget (a width, a count), a format string with such a width, a join or replace too large."""
    method = getattr(func, "__wrapped__", func)  # jinja2 wraps str.format in a sandboxed formatter
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    check_sizes(args, kwargs, name)
    if isinstance(owner, str) and name in ("format", "format_map"):
        check_format(owner)
    elif isinstance(owner, str) and name == "join" and args:
        _check_join(owner, args[0])
    elif isinstance(owner, str) and name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])


def check_sizes(args: tuple[Any, ...], kwargs: dict[str, Any], name: str = "") -> None:
    """Refuse integer arguments past the text budget (a width, a count, a repeat) of `name`."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > TEXT_BUDGET:
            shown = {"safe_range": "range", "%": ""}.get(name, name)  # jinja2's sandboxed range; a % b
            what = f"{shown}() argument" if shown else "argument"
            raise TemplateBudgetError(f"{what} {value} is over the size budget of {TEXT_BUDGET}")


def _check_join(separator: Any, items: Any) -> None:
    """Refuse `separator.join(items)` past the text budget (`items` sized: a list, tuple, range)."""
    count = _sized(items)
    if not isinstance(separator, str) or count is None or isinstance(items, str):
        return
    size = len(separator) * max(count - 1, 0)
    if isinstance(items, list | tuple):
        size += sum(len(x) for x in items if isinstance(x, str))
    if size > TEXT_BUDGET:
        raise _too_big("a joined text", size, TEXT_BUDGET)


def budget_concat(pieces: Iterable[str]) -> str:
    """jinja2's `environment.concat` (the text of a set block, a macro, a filter block), within the budget."""
    parts = list(pieces)
    size = sum(len(p) for p in parts)
    if size > TEXT_BUDGET:
        raise _too_big("a text", size, TEXT_BUDGET)
    return "".join(parts)


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return
    hits = text.count(old) if old else len(text) + 1
    if len(text) + hits * len(new) > TEXT_BUDGET:
        raise _too_big("a replaced text", len(text) + hits * len(new), TEXT_BUDGET)


def budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` (a jinja2 filter) with the deadline, its arguments and its result checked."""

    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # a pass_context filter's context

    @functools.wraps(func)  # keeps jinja_pass_arg (pass_context / pass_environment filters)
    def run(*args: Any, **kwargs: Any) -> Any:
        tick()
        values = args[skip:]  # the filtered value, then the filter's own arguments
        check_sizes(values[1:], kwargs, name)
        if name == "format" and values and isinstance(values[0], str):
            check_format(values[0])
        elif name == "join" and values:
            values = (_materialized(values[0]), *values[1:])
            _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), values[0])
            args = (*args[:skip], *values)
        elif name == "replace" and len(values) >= 3:
            _check_replace(values[0], values[1], values[2])
        return checked(func(*args, **kwargs))

    return run


def _materialized(items: Any) -> Any:
    """`items` as a list when it is an iterator (a join's size is known only then), else itself."""
    if _sized(items) is not None or not hasattr(items, "__iter__"):
        return items
    return checked(list(loop_iterations(items)))


def loop_iterations(iterable: Iterable[Any]) -> Iterator[Any]:
    """The items of a for loop's iterable, the deadline and the render's iteration count checked before each."""
    for item in iterable:
        tick()
        _state.iterations = getattr(_state, "iterations", 0) + 1
        if _state.iterations > ITERATIONS_BUDGET:
            raise TemplateBudgetError(f"its for loops ran more than the budget of {ITERATIONS_BUDGET} iterations")
        yield item


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja2's names
    """jinja2's lipsum global, bounded (it builds n paragraphs of min..max words in one call)."""
    from jinja2.utils import generate_lorem_ipsum

    if n > 1000 or max > 10000:
        raise _too_big("lipsum", n * max, 1000 * 10000, "words")
    return str(generate_lorem_ipsum(n=n, html=html, min=min, max=max))


class BudgetSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the budget of this module on every operation."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        check_binop(operator, left, right)
        return checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's
        tick()
        check_arguments(__obj, args, kwargs)
        return checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return checked(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return checked(super().getitem(obj, argument))


def budget_environment(**options: Any) -> BudgetSandbox:
    """A BudgetSandbox without constant folding, jinja2's `lipsum` bounded; add filters, then `seal` it."""
    env = BudgetSandbox(optimized=False, **options)
    env.concat = budget_concat  # type: ignore[method-assign]  # jinja2 declares it a plain attribute
    env.globals["lipsum"] = _lipsum
    return env


def seal(env: BudgetSandbox) -> None:
    """Budget every filter of `env` (call after adding the template's own) and register the for-loop
    filter. Globals need nothing: a template calls them through `BudgetSandbox.call`."""
    env.filters = {name: budgeted_filter(name, f) for name, f in env.filters.items()}
    env.filters[LOOP_FILTER] = loop_iterations


def budget_loops(tree: nodes.Template) -> nodes.Template:
    """`tree` with every for loop's iterable wrapped in LOOP_FILTER (a deadline check per iteration)."""
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, LOOP_FILTER, [], [], None, None, lineno=loop.lineno)
    return tree


def render_budgeted(template: Any, variables: dict[str, Any], seconds: float | None = None) -> str:
    """`template.render(**variables)` within `seconds` (None: RENDER_SECONDS), the prompt's length counted."""
    pieces: list[str] = []
    total = 0
    with deadline(RENDER_SECONDS if seconds is None else seconds):
        for piece in template.generate(**variables):
            total += len(piece)
            if total > TEXT_BUDGET:
                raise _too_big("the rendered prompt", total, TEXT_BUDGET)
            pieces.append(piece)
    return "".join(pieces)
