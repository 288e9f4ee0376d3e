"""Matrices that tensor or expert parallelism splits, as Muon sees them.

A tensor-parallel slice is gathered over its group by its data-parallel owner, orthogonalised whole,
and the owner keeps its own slice; expert parallelism splits between matrices, so nothing is
gathered. Why, and how the owners agree (:func:`check_peers_agree`): the comment at
:class:`TensorSplit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..tensor import RaggedShardPlacement

__all__ = ["TensorSplit", "check_peers_agree", "tensor_split"]


# Beside FSDP, tensor parallelism gives a parameter ``Shard(d)`` on a mesh dimension of its own
# (``ColwiseParallel``: rows, ``RowwiseParallel``: columns): each tensor-parallel rank holds a slice
# of the matrix, and raggedfsdp's ragged shard over the data-parallel dimension is cut from that
# slice. Newton–Schulz is not elementwise: orthogonalising the slice instead of the matrix is
# silently wrong. So the data-parallel owner of a slice gathers the slices over the tensor-parallel
# group, orthogonalises the whole matrix and keeps its own slice of the result. The owners agree:
# tensor-parallel peers hold equal slices (an even split is required), so their shard layouts and
# owner plans are equal, and every peer owns the same matrices in the same order, when every rank
# built the same model and plan; :func:`check_peers_agree` makes that an error rather than a trust,
# once per bucket (a peer pairing other matrices would gather the wrong slices, or wait in a
# collective the others never enter). Each peer runs the same kernel on the same matrix: the numbers
# of one device.
#
# Expert parallelism (``Shard(0)`` of a stack ``[E, rows, cols]``) splits between matrices, never
# inside one: nothing to gather. Any other split of a stack is refused.
@dataclass(frozen=True)
class TensorSplit:
    """A matrix split along ``dim`` (0: rows, 1: columns) into ``size`` equal slices over
    ``group``, of which this rank holds slice ``rank``."""

    dim: int
    group: dist.ProcessGroup
    size: int
    rank: int

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole matrix from this rank's slice ``part`` (a collective over the group)."""
        parts = [torch.empty_like(part) for _ in range(self.size)]
        # The list form with equal slices: Gloo has no all_gather_into_tensor.
        dist.all_gather(parts, part.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.dim)

    def own(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``whole``."""
        return whole.chunk(self.size, dim=self.dim)[self.rank]


def tensor_split(param: torch.Tensor, label: str) -> TensorSplit | None:
    """How tensor parallelism splits the matrix ``param`` (``None``: each of its matrices is
    whole on this rank, as with expert parallelism or none).

    Raises ``ValueError`` naming ``label`` for a split whose orthogonalisation would not be one
    device's: more than one split, a placement other than ``Shard``, a stack of matrices split
    inside its matrices, or an uneven split.
    """
    if not isinstance(param, DTensor):
        return None
    splits = [
        (mesh_dim, placement)
        for mesh_dim, placement in enumerate(param.placements)
        if not isinstance(placement, (Replicate, RaggedShardPlacement))
    ]
    if not splits:
        return None
    mesh_dim, placement = splits[0]
    if len(splits) > 1 or type(placement) is not Shard:
        raise ValueError(
            f"Muon: {label} is split as {param.placements}; Muon gathers a matrix over one "
            f"Shard placement of tensor parallelism only"
        )
    dim = placement.dim % param.ndim
    if param.ndim == 3:
        if dim == 0:
            return None  # experts over ep: whole matrices
        raise ValueError(
            f"Muon: {label} is a stack of matrices split inside each matrix ({placement}); "
            f"Muon orthogonalises each matrix whole: split a stack by Shard(0) only"
        )
    mesh = param.device_mesh
    size = mesh.size(mesh_dim)
    if param.shape[dim] % size:
        raise ValueError(
            f"Muon: {label} is split by {placement} over {size} ranks, unevenly "
            f"({param.shape[dim]} is not a multiple of {size}); Muon needs equal slices to "
            f"gather the matrix"
        )
    return TensorSplit(dim, mesh.get_group(mesh_dim), size, mesh.get_local_rank(mesh_dim))


def check_peers_agree(
    pg: dist.ProcessGroup | None, items: list[tuple[str, TensorSplit, tuple[object, ...]]]
) -> None:
    """``ValueError`` on every rank unless each tensor-parallel group's ranks hold the same
    matrices in the same order, each sharded alike over the data-parallel group ``pg``:
    ``items`` are this rank's split matrices of one bucket, as ``(label, split, layout)``
    (``layout``: the slice's shape and its ranges over ``pg``). Collectives: one object gather
    per tensor-parallel group, then one all-reduce over ``pg``, so that a group that
    disagrees stops every rank, not only its own."""
    groups: dict[int, tuple[dist.ProcessGroup, list[tuple[str, tuple[object, ...]]]]] = {}
    for label, split, layout in items:
        groups.setdefault(id(split.group), (split.group, []))[1].append((label, layout))
    problem = ""
    for group, mine in groups.values():
        peers: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, mine, group=group)
        for rank, theirs in enumerate(peers):
            if theirs != mine and not problem:
                ranks = dist.get_process_group_ranks(group)
                problem = _first_difference(mine, theirs, ranks[rank])  # type: ignore[arg-type]
    failed = torch.tensor([int(bool(problem))])
    if pg is not None:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=pg)
    if failed.item():
        raise ValueError(
            "Muon: tensor-parallel peers hold different matrices or shard layouts "
            f"({problem or 'on another tensor-parallel group'}): build the model, its tensor "
            "parallelism and raggedfsdp's plan identically on every rank"
        )


def _first_difference(
    mine: list[tuple[str, tuple[object, ...]]],
    theirs: list[tuple[str, tuple[object, ...]]],
    rank: int,
) -> str:
    for (label, layout), (other_label, other) in zip(mine, theirs, strict=False):
        if (label, layout) != (other_label, other):
            return f"here {label} {_words(layout)}; on rank {rank} {other_label} {_words(other)}"
    return f"{len(mine)} split matrices here, {len(theirs)} on rank {rank}"


def _words(layout: tuple[object, ...]) -> str:
    shape, ranges = layout
    return f"has a slice {list(shape)} cut {list(ranges)} over the data-parallel ranks"  # type: ignore[call-overload]
