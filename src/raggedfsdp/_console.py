"""What the ``raggedfsdp`` commands print and how they exit.

Exit statuses, one-line errors, byte counts; and how they write a file a user named: checked before
the work, written whole.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "USAGE_ERROR",
    "arg_type",
    "check_writable",
    "format_bytes",
    "one_line",
    "write_whole",
]

#: Exit status of a user error: a bad argument, option or input (argparse's convention).
USAGE_ERROR = 2

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
#: Free bytes below which a file system counts as full: a write that failed there failed for it.
_NEARLY_FULL = 1 << 20


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


def _partial(target: Path) -> Path:
    """A new, empty hidden file beside ``target`` (the same file system, so a rename moves it
    there), made under a random name that must not exist yet: a file or link planted at a name
    guessed beforehand is never written through. Its mode is the umask's, as ``open``'s."""
    while True:
        partial = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return partial


def check_writable(target: Path, what: str) -> None:
    """``ValueError`` naming ``what`` (the option) unless a file can be written at ``target``
    (its missing folders made): before the work that makes it, so that a mistake costs one
    line, not the work. Judged by writing a probe file, which a permission bit does not tell
    for root or a special file system."""
    if target.is_dir():
        raise ValueError(f"{what} {str(target)!r} is a folder; give a file name")
    folder = target.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{what} {str(target)!r}: {str(folder)!r} is a file, not a folder")
    try:
        _partial(folder / target.name).unlink()
    except OSError as err:
        raise ValueError(
            f"{what} {str(target)!r}: cannot write in {str(folder)!r} ({err.strerror or err})"
        ) from None


def write_whole(target: Path, write: Callable[[Path], None]) -> None:
    """``write(path)`` to a temporary file beside ``target``, then renamed to it: a failure
    leaves no part of the file (and ``target`` as it was). Any failure is an ``OSError`` naming
    ``target``; a full disk is said as such, whatever the library's error (torch.save's
    "unexpected pos", safetensors' "I/O error")."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(target)
    try:
        write(partial)
        os.replace(partial, target)
    except Exception as err:
        free = shutil.disk_usage(target.parent).free  # with the partial file still there
        partial.unlink(missing_ok=True)
        if free < _NEARLY_FULL or "No space left" in str(err):
            cause = f"No space left on device ({format_bytes(free)} free)"
        elif isinstance(err, OSError):
            cause = one_line(err)
        else:
            cause = f"{type(err).__name__}: {one_line(err)}"
        raise OSError(f"cannot write {str(target)!r}: {cause}") from err
