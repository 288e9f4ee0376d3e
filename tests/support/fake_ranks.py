"""One rank of a large world in this process: torch's fake process group, whose collectives
complete at once and move no data, so the runtime's NCCL branch (every group on the fake
backend takes it) runs at W = 1024 without 1024 processes. Each rank's view is one
:func:`fake_world` block; a test loops over a few ranks and compares what they issued
(``collective_wrap.recording``).

The fake collectives leave outputs as they were (an all-gather copies the input into every
slot), which could hand the runtime garbage it refuses (a NaN scale in a compressed message);
:func:`as_if_every_rank_were_this_one` fills every output as if all ranks held this rank's
data, so the numbers stay finite and well formed. Nothing a test asserts depends on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from collective_wrap import Call, wrapped_collectives

__all__ = ["as_if_every_rank_were_this_one", "fake_world"]


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process is rank ``rank`` of ``world`` on the fake backend for the block, its
    collectives filled by :func:`as_if_every_rank_were_this_one`."""
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with wrapped_collectives(as_if_every_rank_were_this_one):
            yield
    finally:
        dist.destroy_process_group()


def as_if_every_rank_were_this_one(call: Call) -> Any:
    """The fake call, then its output as if every rank of the group had sent what this rank
    sent: an all-gather's every slot this rank's input, a reduce-scatter's output this rank's
    own chunk (the mean of equal chunks), an all-to-all's every chunk the one this rank sends
    itself. All-reduces keep the tensor (the mean of equal tensors)."""
    work = call.issue()
    out, inp = call.output, call.input
    if out is None or inp is None or out is inp:
        return work
    world = dist.get_world_size(call.group)
    rank = dist.get_rank(call.group)
    if call.kind == "all_gather":
        mine = inp.reshape(1, -1).clone()  # in place, the input is a slot of the output
    elif call.kind in ("reduce_scatter", "all_to_all"):
        mine = inp.view(world, -1)[rank].reshape(1, -1)
    else:
        return work
    out.view(-1, mine.numel()).copy_(mine.expand(out.numel() // mine.numel(), -1))
    return work
