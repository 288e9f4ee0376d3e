"""What the ``raggedfsdp`` commands print and how they exit: exit statuses, one-line errors,
byte counts."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["USAGE_ERROR", "arg_type", "format_bytes", "one_line"]

#: Exit status of a user error: a bad argument, option or input (argparse's convention).
USAGE_ERROR = 2

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def one_line(err: BaseException) -> str:
    """The error's message on one line (its type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


def format_bytes(n: float | None, unit: str | None = None, *, suffix: bool = True) -> str:
    """``n`` bytes in ``unit`` (one of B, KiB, MiB, GiB, TiB; ``None``: the largest unit that
    keeps the value at least 1), with one decimal and thousands separators; ``"-"`` for
    ``None``. ``suffix=False`` leaves the unit out (for a table whose header names it)."""
    if n is None:
        return "-"
    if unit is None:
        index = 0
        while index < len(_UNITS) - 1 and abs(n) >= 1024 ** (index + 1):
            index += 1
        unit = _UNITS[index]
    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {_UNITS}, got {unit!r}")
    value = n / 1024 ** _UNITS.index(unit)
    text = f"{value:,.0f}" if unit == "B" else f"{value:,.1f}"
    return f"{text} {unit}" if suffix else text


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """Adapt a ``ValueError``-raising parser to argparse, keeping its message."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__
    return convert
