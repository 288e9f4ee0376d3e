"""What each rank's backward runs and uses, agreed at its start by one small all-reduce.

Which units any rank's backward runs (for ranks whose graphs differ: ``_sequence.py``) and which
parameters any rank used, so that one no rank used keeps ``.grad`` ``None`` as in one process
(torch's optimizers then skip it rather than decay it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge
from torch.autograd.profiler import record_function

from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._param import FSDPParam

__all__ = ["Agreed", "Seen", "Usage", "agree", "order_digest", "will_run"]


def will_run(node: object) -> bool:
    """Whether the backward under way runs the autograd ``node`` (only inside a backward)."""
    return bool(torch._C._will_engine_execute_node(node))


class Usage:
    """One unit's record of which of its trainable ``params`` get a gradient on this rank since
    its last synchronised backward (``used``), and which held a sharded gradient when this
    backward began."""

    def __init__(self, params: list[FSDPParam]) -> None:
        self.params = params
        self.used = [False] * len(params)
        self._held = list(self.used)

    def begin_backward(self) -> None:
        """A backward under the unit's root begins (inside it): note which sharded gradients are
        held, and which parameters this backward computes gradients of."""
        self._held = [param.sharded.grad is not None for param in self.params]
        for i, param in enumerate(self.params):
            self.used[i] = self.used[i] or will_run(get_gradient_edge(param.unsharded).node)

    def settle(self) -> None:
        """After a synchronised backward whose agreement made ``used`` what any rank used: a
        parameter none used had only zeros reduced into it, so its gradient goes back to what it
        was before the backward, ``None`` where it was none (as one process leaves it). The
        record starts again."""
        for param, used, held in zip(self.params, self.used, self._held, strict=True):
            if not (used or held):
                param.sharded.grad = None
        self.restart()

    def restart(self) -> None:
        self.used = [False] * len(self.params)


class Unit(Protocol):
    """What the agreement asks of a unit (its parameter group)."""

    usage: Usage
    mesh_info: MeshInfo
    device: torch.device

    def reduces_now(self) -> bool:
        """Whether this backward reduces the unit's gradients."""
        ...


@dataclass(frozen=True)
class Seen:
    """What this rank's backward does with a unit: whether it runs the unit's backward, and how
    many of its forwards' routed inputs get gradients (each ends a pass of its backward, after
    which it reduces; none: it reduces at the end of the backward)."""

    runs: bool
    routed: int


@dataclass(frozen=True)
class Agreed:
    """Per unit, over the data-parallel ranks: whether any rank's backward runs it, whether they
    reduce it when its backward ends (every rank that runs it has routed inputs), and whether
    every rank ran the units in the order ``agree`` was given the digest of; and whether some
    rank's forward ran a unit again after others (``revisit``), and every rank the same one."""

    runs: list[bool]
    reduces_early: list[bool]
    #: whether the ranks' counts of routed passes differ (then each reduces once, at its last)
    passes_differ: list[bool]
    same_order: bool
    revisit: bool = False
    revisit_alike: bool = False


# One all-reduce (MAX, bytes) per distinct mesh at the start of each backward (one for FSDP, one
# per mesh beside expert parallelism; over both dims for HSDP) carries, per unit, what this rank's
# backward runs (``Seen``) and, per parameter, whether it was used; the first one also a digest of
# the order the first forward ran the units in. A forward that runs a unit again after others
# sends the same message with the unit's position instead, where the other ranks are either
# running it again too or starting their backward (``_sequence.py``). Every rank reads it on the
# host (a sync on an accelerator): even a rank whose backward runs and uses everything must learn
# that another rank's forward went on or that another reduces a unit later
# (``set_static_graph()`` makes neither the all-reduce nor the read).
def agree(
    units: list[Unit],
    seen: list[Seen],
    digest: bytes | None,
    stats: RuntimeStats,
    *,
    revisit: int | None = None,
) -> Agreed:
    """Start of a backward: agree over the data-parallel ranks on ``seen`` (per unit) and on the
    units' usage records (every rank calls it, with the units in the same order); the usage
    records become what any rank used. With ``revisit`` (a position in the units' order),
    inside a forward that runs that unit again: the same message with nothing seen or used,
    only the position, and the records are left alone."""
    by_mesh: dict[tuple[int, int], list[int]] = {}
    for i, unit in enumerate(units):
        info = unit.mesh_info
        by_mesh.setdefault((id(info.shard_group), id(info.replicate_group)), []).append(i)
    masks: list[torch.Tensor | list[int]] = []
    for members in by_mesh.values():
        info = units[members[0]].mesh_info
        data = list(_revisit_bytes(revisit))
        # per unit: runs, runs with no routed input, its routed passes and their complement
        data += [v for i in members for v in _unit_bytes(seen[i])]
        data += [int(f and revisit is None) for i in members for f in units[i].usage.used]
        data += list(_order_bytes(digest))
        masks.append(_all_reduce_max(data, info, units[members[0]].device, stats))
    sent = [mask for mask in masks if isinstance(mask, torch.Tensor)]
    read = torch.cat(sent).tolist() if sent else []  # the one host read, a sync on an accelerator
    runs, early, differ = [False] * len(units), [False] * len(units), [False] * len(units)
    same_order, again, alike = True, False, True
    at = 0
    for members, mask in zip(by_mesh.values(), masks, strict=True):
        if isinstance(mask, torch.Tensor):
            values, at = read[at : at + mask.numel()], at + mask.numel()
        else:
            values = mask
        again = again or values[0] > 0
        alike = alike and _agrees(values[:2]) and _agrees(values[2:_REVISIT_BYTES])
        pos = _REVISIT_BYTES
        for i in members:
            ran, late, most, least = *values[pos : pos + 3], 255 - values[pos + 3]
            runs[i], early[i], differ[i] = bool(ran), most > 0 and not late, most != least
            pos += 4
        for i in members:
            used = units[i].usage.used
            if revisit is None:
                used[:] = [bool(v) for v in values[pos : pos + len(used)]]
            pos += len(used)
        if digest is not None:
            same_order &= _agrees(values[pos : pos + 16])
    return Agreed(runs, early, differ, same_order, again, again and alike)


def _all_reduce_max(
    data: list[int], info: MeshInfo, device: torch.device, stats: RuntimeStats
) -> torch.Tensor | list[int]:
    """``data`` (bytes) after a MAX over the mesh's ranks, to be read; a mesh of one rank keeps
    it as it is (no collective, nothing to read back: FSDP2 issues none at world size 1)."""
    if info.shard_size * info.replicate_size == 1:
        return data
    data = data + [1] * (-len(data) % 16)  # 16 bytes, as every message NCCL moves here
    mask = torch.tensor(data, dtype=torch.uint8, device=device)
    with record_function("raggedfsdp::agree_on_usage"):
        for pg in (info.shard_group, info.replicate_group):
            if pg is not None:
                dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=pg)
                stats.usage_all_reduces += 1
    return mask


#: The message's head: whether this rank runs a unit again and its complement (2 bytes), then the
#: unit's position as a digest and its complement (16).
_REVISIT_BYTES = 18


def _revisit_bytes(revisit: int | None) -> bytes:
    """Whether this rank runs a unit again, its complement, and the unit's position as
    ``_order_bytes`` sends a digest (agreeing only where every rank sends the same)."""
    flag = int(revisit is not None)
    digest = order_digest(None if revisit is None else [revisit])
    return bytes([flag, 255 - flag]) + _order_bytes(digest)


def _agrees(values: list[int]) -> bool:
    """After a MAX over ranks of bytes followed by their complements: every rank sent the same
    bytes (the complement's MAX is the complement of the MIN)."""
    half = len(values) // 2
    return all(a + b == 255 for a, b in zip(values[:half], values[half:], strict=True))


def _unit_bytes(seen: Seen) -> tuple[int, int, int, int]:
    passes = min(seen.routed, 255)
    return int(seen.runs), int(seen.runs and not seen.routed), passes, 255 - passes


def order_digest(positions: list[int] | None) -> bytes:
    """8 bytes naming an order of units (their positions in the modules' order); ``None``: this
    rank did not run them all, which no other rank's digest can agree with."""
    if positions is None:
        return b""
    return hashlib.sha256(bytes(str(positions), "ascii")).digest()[:8]


def _order_bytes(digest: bytes | None) -> bytes:
    """A digest and its complement: after a MAX over ranks, each byte pair adds up to 255 only
    where every rank sent the same byte (the complement's MAX is the complement of the MIN). An
    empty digest sends 255s in both, which agrees with nothing."""
    if digest is None:
        return b""
    if not digest:
        return bytes([255] * 16)
    return digest + bytes(255 - b for b in digest)
