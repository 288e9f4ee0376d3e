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
    """What this rank's backward does with a unit: whether it runs the unit's backward, and
    whether it reduces the unit's gradients when that ends (its inputs need gradients: the
    ``_PostBackward`` node runs) rather than at the end of the backward."""

    runs: bool
    reduces_early: bool


@dataclass(frozen=True)
class Agreed:
    """Per unit, over the data-parallel ranks: whether any rank's backward runs it, whether any
    reduces it early, and whether every rank ran the units in the order ``agree`` was given the
    digest of."""

    runs: list[bool]
    reduces_early: list[bool]
    same_order: bool


# One all-reduce (MAX, bytes) per distinct mesh at the start of each backward (one for FSDP, one
# per mesh beside expert parallelism; over both dims for HSDP) carries, per unit, what this rank's
# backward runs (``Seen``) and, per parameter, whether it was used; the first one also a digest of
# the order the first forward ran the units in. Read on the host once, by a rank that skips a unit
# or did not use a parameter (or the first time), and never by the others: a rank whose backward
# runs every unit and uses every parameter needs nothing from the others (a static graph costs the
# all-reduce, never a host sync).
def agree(
    units: list[Unit], seen: list[Seen], digest: bytes | None, stats: RuntimeStats
) -> Agreed | None:
    """Start of a backward: agree over the data-parallel ranks on ``seen`` (per unit) and on the
    units' usage records (every rank calls it, with the units in the same order). ``None``:
    nothing to read (this rank runs and uses everything, ``digest`` is ``None``). The units'
    usage records become what any rank used."""
    by_mesh: dict[tuple[int, int], list[int]] = {}
    for i, unit in enumerate(units):
        info = unit.mesh_info
        by_mesh.setdefault((id(info.shard_group), id(info.replicate_group)), []).append(i)
    masks = []
    for members in by_mesh.values():
        info = units[members[0]].mesh_info
        flags = [f for i in members for f in (seen[i].runs, seen[i].reduces_early)]
        flags += [f for i in members for f in units[i].usage.used]
        data = [int(f) for f in flags] + list(_order_bytes(digest))
        data += [1] * (-len(data) % 16)  # 16 bytes, as every message NCCL moves here
        mask = torch.tensor(data, dtype=torch.uint8, device=units[members[0]].device)
        with record_function("raggedfsdp::agree_on_usage"):
            for pg in (info.shard_group, info.replicate_group):
                if pg is not None:
                    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=pg)
                    stats.usage_all_reduces += 1
        masks.append(mask)
    everything = all(s.runs for s in seen) and all(all(u.usage.used) for u in units)
    if digest is None and everything:
        return None
    read = torch.cat(masks).tolist()  # the one host read, a sync on an accelerator
    runs, early = [False] * len(units), [False] * len(units)
    same_order = True
    at = 0
    for members, mask in zip(by_mesh.values(), masks, strict=True):
        values = read[at : at + mask.numel()]
        at += mask.numel()
        for k, i in enumerate(members):
            runs[i], early[i] = bool(values[2 * k]), bool(values[2 * k + 1])
        pos = 2 * len(members)
        for i in members:
            used = units[i].usage.used
            used[:] = [bool(v) for v in values[pos : pos + len(used)]]
            pos += len(used)
        if digest is not None:
            ours, theirs = values[pos : pos + 8], values[pos + 8 : pos + 16]
            same_order &= all(a + b == 255 for a, b in zip(ours, theirs, strict=True))
    return Agreed(runs, early, same_order)


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
