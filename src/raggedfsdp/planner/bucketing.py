"""The one bucketing: which FSDP units a model has, and how each unit's parameters split into
buckets. ``plan_model``, the ``plan`` command, ``train --dry-run`` and the runtime all use it, so
what is planned is what runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn

__all__ = ["bucket_params", "default_wrap_units", "parse_buffer_size", "split_by_bytes"]

T = TypeVar("T")


def default_wrap_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """FSDP units of a model, bottom-up: every element of every ``nn.ModuleList``, then the root
    (which takes every parameter not in a unit). Names are fully qualified."""
    units = [
        (f"{name}.{i}" if name else str(i), child)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.ModuleList)
        for i, child in enumerate(sub)
    ]
    return [*units, ("", module)]


def bucket_params(
    module: nn.Module,
    *,
    buffer_size: int | None = None,
    wrap: Callable[[nn.Module], list[tuple[str, nn.Module]]] = default_wrap_units,
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The buckets of a model in model order: ``(label, {name: param})``.

    Each FSDP unit (from ``wrap``) takes its parameters not already taken by an inner unit (tied
    parameters go to the first unit that sees them, under their first name); they are grouped by
    dtype and split at ``buffer_size`` bytes.
    """
    if buffer_size is not None and buffer_size < 1:
        raise ValueError(f"buffer_size must be positive bytes or None, got {buffer_size!r}")
    taken: set[int] = set()
    for prefix, unit in wrap(module):
        by_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = {}
        for pname, p in unit.named_parameters(prefix=prefix):
            if id(p) in taken:
                continue
            taken.add(id(p))
            by_dtype.setdefault(p.dtype, {})[pname] = p
        for dt, group in by_dtype.items():
            chunks = split_by_bytes(
                list(group.items()), lambda kv, dt=dt: kv[1].numel() * dt.itemsize, buffer_size
            )
            for i, chunk in enumerate(chunks):
                yield f"{prefix or '<root>'}/{str(dt).removeprefix('torch.')}/{i}", dict(chunk)


def split_by_bytes(
    items: Sequence[T], nbytes: Callable[[T], int], buffer_size: int | None
) -> list[list[T]]:
    """Model-order chunks of at most ``buffer_size`` bytes (``None``: one chunk); a single item
    larger than that stands alone."""
    if buffer_size is None:
        return [list(items)]
    chunks: list[list[T]] = [[]]
    used = 0
    for item in items:
        size = nbytes(item)
        if chunks[-1] and used + size > buffer_size:
            chunks.append([])
            used = 0
        chunks[-1].append(item)
        used += size
    return chunks


_BINARY_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_buffer_size(text: str) -> int | None:
    """Bytes: ``"none"``, ``"4194304"``, ``"4MiB"``, ``"4M"``, ``"1GiB"`` (K/M/G are binary)."""
    value = text.strip().lower()
    if value == "none":
        return None
    number, scale = value, 1
    for suffix in ("ib", "b"):
        if number.endswith(suffix) and number[: -len(suffix)][-1:] in _BINARY_SUFFIXES:
            number = number[: -len(suffix)]
            break
    if number[-1:] in _BINARY_SUFFIXES:
        number, scale = number[:-1], _BINARY_SUFFIXES[number[-1]]
    if not number.isdigit() or int(number) < 1:
        raise ValueError(
            f"invalid buffer size {text!r}: expected none or a positive number of bytes, "
            f"optionally with K, M or G (binary: 4M = 4MiB = 4194304)"
        )
    return int(number) * scale
