"""How bytes travel between the ranks of a group, for the plain and the quantized collectives.

NCCL runs torch's own collectives (:func:`all_gather_tensor`, :func:`reduce_scatter_tensor`). On
Gloo the runtime posts point-to-point transfers (:func:`exchange`), which write straight into their
destinations ([Note: all-gather on Gloo] and [Note: reduce-scatter on Gloo] in ``_collectives.py``),
unless ``DBufferConfig(gloo_point_to_point=False)`` asks for NCCL's calls on Gloo too
(:func:`point_to_point`): how the NCCL branch runs without a GPU. Shared by ``_collectives.py`` and
``compression/``: one tag namespace (:class:`Tag`), one notion of peers.
"""

from __future__ import annotations

import enum
import functools

import torch
import torch.distributed as dist

from .._host import backend_for

__all__ = [
    "Tag",
    "all_gather_tensor",
    "exchange",
    "is_gloo",
    "peers",
    "point_to_point",
    "reduce_scatter_tensor",
    "world_tensor",
]


# [Note: torch's collectives looked up per call] Every process-group call the runtime's bucket
# collectives make (``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``,
# ``all_reduce``, ``isend``, ``irecv``) finds torch's function on ``torch.distributed`` when it is
# made, never through a name bound at import, so a wrapper of torch's functions sees all of them:
# the tests' emulation of NCCL's asynchrony and their recorder of the collectives each rank issues
# (``tests/support/collective_wrap.py``).
def all_gather_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """torch's all-gather into one tensor: ``output_tensor[r*S:(r+1)*S]`` = rank r's input."""
    # torch >= 2.13 names the tensor forms *_single and deprecates the old names; 2.6 has only
    # those. Looked up per call ([Note: torch's collectives looked up per call]).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input_tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """torch's reduce-scatter of one tensor: ``output`` = ``op`` over ranks of their
    ``input_tensor[r*S:(r+1)*S]``, for this rank ``r``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input_tensor, op=op, group=group, async_op=async_op)


class Tag(enum.IntEnum):
    """Point-to-point tags, one per kind of collective: an all-gather and a reduce-scatter (or
    a quantized one of another bucket) in flight at once between the same two ranks never
    match each other's messages."""

    ALL_GATHER = 1
    REDUCE_SCATTER = 2
    QUANTIZED_ALL_GATHER = 3
    QUANTIZED_ALL_TO_ALL = 4


def peers(group: dist.ProcessGroup | None) -> tuple[int, list[int]]:
    """This rank's index in ``group`` and every other member's, starting after this rank so
    that no member is everyone's first peer."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank, [(rank + step) % world for step in range(1, world)]


def exchange(
    transfers: list[tuple[int, torch.Tensor, torch.Tensor]],
    group: dist.ProcessGroup | None,
    tag: Tag,
) -> list[dist.Work]:
    """For each ``(peer, send, receive)`` (peer: its rank in ``group``), post the send of
    ``send`` to it and the receive of its message into ``receive``; returns the handles."""
    works = []
    for peer, send, receive in transfers:
        to = peer if group is None else dist.get_global_rank(group, peer)
        works.append(dist.isend(send, to, group=group, tag=int(tag)))
        works.append(dist.irecv(receive, to, group=group, tag=int(tag)))
    return works


def is_gloo(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether Gloo carries ``device``'s tensors in ``group``."""
    return backend_for(group, device.type) == "gloo"


def point_to_point(
    group: dist.ProcessGroup | None, device: torch.device, *, gloo_point_to_point: bool
) -> bool:
    """Whether a bucket's collective over ``group`` on ``device`` exchanges shards point to
    point (:func:`exchange`) rather than running torch's tensor collectives, the calls NCCL
    gets: on Gloo, unless ``gloo_point_to_point`` (``DBufferConfig.gloo_point_to_point``) is
    off."""
    return gloo_point_to_point and is_gloo(group, device)


@functools.cache
def world_tensor(world: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``world`` as a 0-d tensor, made once: dividing by a Python number would convert it to a
    tensor on every call."""
    return torch.tensor(world, dtype=dtype, device=device)
