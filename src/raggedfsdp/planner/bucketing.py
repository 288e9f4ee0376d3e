"""The one bucketing: a model's FSDP units, and how each unit's parameters split into buckets.

``plan_model``, the ``plan`` command, ``train --dry-run`` and the runtime all use it, so what is
planned is what runs. A unit's parameters are grouped by ``(dtype, requires_grad)`` in model order
(first appearance decides the group order), and each group is split in model order at
``buffer_size`` bytes *of the communication dtype* (``param_dtype`` under mixed precision: what the
collectives move). A bucket is named ``<unit path>/<dtype>[/frozen]/<i>`` (``<root>`` for the root's
path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

__all__ = [
    "Bucket",
    "LocalPiece",
    "WrapPolicy",
    "model_buckets",
    "parse_buffer_size",
    "post_order",
    "split_by_bytes",
    "unit_buckets",
    "wrap_units",
]

T = TypeVar("T")

#: Which modules are FSDP units (besides the root): ``None`` means every element of every
#: ``nn.ModuleList`` (the blocks of a transformer).
WrapPolicy = Callable[[nn.Module], bool] | None


@dataclass(frozen=True)
class Bucket:
    """The parameters of one collective, before planning."""

    name: str  # ``<unit path>/<dtype>[/frozen]/<i>``
    params: dict[str, torch.Tensor]  # name -> parameter, in model order
    dtype: torch.dtype  # the master (sharded) dtype
    comm_dtype: torch.dtype  # what the collectives move: param_dtype under mixed precision
    requires_grad: bool

    @property
    def plan_dtype(self) -> torch.dtype:
        """The dtype to plan in: the narrower of the two, so the alignment (in elements) suits
        both the local shard and the communication buffer."""
        return self.comm_dtype if self.comm_dtype.itemsize < self.dtype.itemsize else self.dtype


def _bucket_name(unit_path: str, dtype: torch.dtype, requires_grad: bool, index: int) -> str:
    """``<unit path>/<dtype>[/frozen]/<i>``; the root's path is ``<root>``."""
    frozen = "" if requires_grad else "/frozen"
    return f"{unit_path or '<root>'}/{str(dtype).removeprefix('torch.')}{frozen}/{index}"


def _comm_dtype(dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """What the collectives move for a parameter of ``dtype``: ``param_dtype`` for floating
    parameters under mixed precision, else its own dtype."""
    return param_dtype if param_dtype is not None and dtype.is_floating_point else dtype


def unit_buckets(
    unit_path: str,
    params: Sequence[tuple[str, torch.Tensor]],
    *,
    param_dtype: torch.dtype | None = None,
    buffer_size: int | None = None,
) -> list[Bucket]:
    """The buckets of one unit whose parameters are ``params`` (name, tensor) in model order."""
    if buffer_size is not None and (isinstance(buffer_size, bool) or buffer_size < 1):
        raise ValueError(f"buffer_size must be positive bytes or None, got {buffer_size!r}")
    groups: dict[tuple[torch.dtype, bool], list[tuple[str, torch.Tensor]]] = {}
    for name, p in params:
        groups.setdefault((p.dtype, p.requires_grad), []).append((name, p))
    buckets = []
    for (dtype, requires_grad), members in groups.items():
        comm = _comm_dtype(dtype, param_dtype)
        chunks = split_by_bytes(members, lambda kv, c=comm: kv[1].numel() * c.itemsize, buffer_size)
        for i, chunk in enumerate(chunks):
            name = _bucket_name(unit_path, dtype, requires_grad, i)
            buckets.append(Bucket(name, dict(chunk), dtype, comm, requires_grad))
    return buckets


def wrap_units(module: nn.Module, wrap: WrapPolicy = None) -> list[tuple[str, nn.Module]]:
    """The FSDP units of a model, each after the units nested inside it (siblings in model
    order), the root last: ``(path, module)``. This is the order ``FSDPBackend`` applies
    ``fully_shard`` in, so a parameter two units share goes to the first (innermost) one."""
    if wrap is None:
        chosen = {
            id(child) for sub in module.modules() if isinstance(sub, nn.ModuleList) for child in sub
        }
    else:
        chosen = {id(m) for m in module.modules() if m is not module and _is_unit(wrap, m)}
    return post_order(module, lambda m: id(m) in chosen)


def _is_unit(wrap: Callable[[nn.Module], bool], module: nn.Module) -> bool:
    """``wrap(module)``, which must be a bool: a function returning the units themselves (the
    earlier ``plan_model(wrap=...)``) would otherwise make every module a unit, silently."""
    answer = wrap(module)
    if not isinstance(answer, bool):
        raise TypeError(
            f"wrap must return True or False for each module (is it an FSDP unit?), got "
            f"{type(answer).__name__} for {type(module).__name__}"
        )
    return answer


def post_order(
    module: nn.Module, is_unit: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    """``(path, unit)`` for every submodule where ``is_unit`` holds, children before their
    parents, then ``module`` itself (path ``""``); a module reachable twice is visited once."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module, bool]] = [("", module, False)]
    while stack:
        path, sub, expanded = stack.pop()
        if expanded:
            if sub is not module and is_unit(sub):
                out.append((path, sub))
            continue
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        stack.append((path, sub, True))
        for name, child in reversed(list(sub.named_children())):
            stack.append((f"{path}.{name}" if path else name, child, False))
    return [*out, ("", module)]


#: What one rank holds of a parameter: ``(name, parameter) -> tensor`` (its tensor- or
#: expert-parallel piece, e.g. on the meta device), or ``None`` when it holds none of it.
LocalPiece = Callable[[str, torch.Tensor], torch.Tensor | None]


def model_buckets(
    module: nn.Module,
    *,
    param_dtype: torch.dtype | None = None,
    buffer_size: int | None = None,
    wrap: WrapPolicy = None,
    local: LocalPiece | None = None,
) -> list[Bucket]:
    """Every bucket of a model, unit by unit in :func:`wrap_units` order, parameters named by
    their fully qualified names. Each unit takes its parameters that no earlier unit took (a
    tied parameter goes to the first unit that sees it, under its first name).

    ``local``: bucket what one rank holds of each parameter instead of the parameter (tensor and
    expert parallelism plan the local tensors, ``capacity/parallel.py``); the buckets split at
    ``buffer_size`` bytes of those pieces (a unit that holds nothing has no bucket)."""
    taken: set[int] = set()
    buckets = []
    for path, unit in wrap_units(module, wrap):
        params = []
        for name, p in unit.named_parameters(prefix=path):
            if id(p) in taken:
                continue
            taken.add(id(p))
            piece = p if local is None else local(name, p)
            if piece is not None:
                params.append((name, piece))
        buckets += unit_buckets(path, params, param_dtype=param_dtype, buffer_size=buffer_size)
    return buckets


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
