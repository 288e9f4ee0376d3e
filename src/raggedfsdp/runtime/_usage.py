"""Which parameters any rank used, so that one no rank used keeps ``.grad`` ``None``.

As one process would leave it, so torch's optimizers skip it rather than decay it. Each unit records
which parameters got a gradient on this rank; :func:`agree_on_usage` ORs the records over the
data-parallel ranks (why, and what it costs: the comment there).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ._mesh import MeshInfo
from ._metrics import RuntimeStats
from ._param import FSDPParam

__all__ = ["Usage", "agree_on_usage"]


class Usage:
    """One unit's record of which of its trainable ``params`` got a gradient on this rank since
    its last synchronised backward (``used``, set by its gradient hooks), and which held a
    sharded gradient when this backward began."""

    def __init__(self, params: list[FSDPParam]) -> None:
        self.params = params
        self.used = [False] * len(params)
        self._held = list(self.used)

    def begin_backward(self) -> None:
        """A backward under the unit's root begins: note which sharded gradients are held."""
        self._held = [param.sharded.grad is not None for param in self.params]

    def settle(self, anywhere: list[bool] | None) -> None:
        """After a synchronised backward, ``anywhere[i]``: whether any data-parallel rank used
        the ``i``-th parameter (``None``: this rank used them all). One that none used had
        only zeros reduced into it: its gradient goes back to what it was before the backward,
        ``None`` where it was none (as one process leaves it). The record starts again."""
        if anywhere is not None:
            for param, used, held in zip(self.params, anywhere, self._held, strict=True):
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


# Every rank joins every reduce-scatter, so a parameter that some rank did not use gets that rank's
# zeros, which is right, and a parameter that no rank used gets zeros everywhere, which is not: one
# process would leave its ``.grad`` ``None``. Each unit records, per parameter, whether a gradient
# arrived on this rank since its last synchronised backward; at the end of such a backward the
# records are OR-ed over the data-parallel ranks by one small all-reduce per distinct mesh (one for
# FSDP, one per mesh beside expert parallelism; over both dims for HSDP), read on the host once by a
# rank that did not use some parameter itself, and not at all by the others (a static graph costs
# the all-reduces, never a host sync).
def agree_on_usage(groups: list[Unit], stats: RuntimeStats) -> None:
    """End of a backward: OR the units' usage records over their data-parallel ranks and let
    each unit clear the gradients of the parameters no rank used (every rank calls it, with the
    units in the same order)."""
    syncing = [group for group in groups if group.reduces_now()]
    by_mesh: dict[tuple[int, int], list[Unit]] = {}
    for group in syncing:
        info = group.mesh_info
        by_mesh.setdefault((id(info.shard_group), id(info.replicate_group)), []).append(group)
    masks = []
    for members in by_mesh.values():
        info = members[0].mesh_info
        used = [flag for group in members for flag in group.usage.used]
        used += [True] * (-len(used) % 16)  # 16 bytes, as every message NCCL moves here
        mask = torch.tensor(used, dtype=torch.uint8, device=members[0].device)
        with record_function("raggedfsdp::agree_on_usage"):
            for pg in (info.shard_group, info.replicate_group):
                if pg is not None:
                    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=pg)
                    stats.usage_all_reduces += 1
        masks.append(mask)
    # Only a parameter this rank did not use can be one no rank used: a rank that used all of
    # its parameters joins the all-reduces but never reads the result (no host sync).
    anywhere: list[int] | None = None
    if not all(all(group.usage.used) for group in syncing):
        anywhere = torch.cat(masks).tolist()  # the one host read, a sync on an accelerator
    start = 0
    for members, mask in zip(by_mesh.values(), masks, strict=True):
        at = start
        for group in members:
            usage = group.usage
            flags = None if anywhere is None else anywhere[at : at + len(usage.used)]
            usage.settle(None if flags is None else [bool(f) for f in flags])
            at += len(usage.used)
        start += mask.numel()
