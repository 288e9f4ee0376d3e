"""FSDP2's ``reshard_after_forward=N``: after forward, keep the unsharded buckets sharded over
groups of ``N`` ranks; backward all-gathers them within the group.

FSDP2's post-forward mesh is the unit's mesh viewed as rows of ``N`` consecutive shard ranks
(``mesh.mesh.view(-1, N)``; HSDP's replicas flattened into the rows), and a rank keeps piece
``shard_rank % N`` of each parameter split ``N`` ways. Here each bucket's gathered buffer (``W*S``
elements, every rank's shard in turn) is what is split: a rank keeps its ``1/N`` of the buffer,
and backward's all-gather over its row refills the buffer in place, ``1/N`` of it from each of the
row's ranks -- the same bytes per rank as FSDP2's (``(N-1)/N`` of the buffer received), over the
smaller group (a node's ranks, say). The kept pieces are counted as unsharded memory, and apart
(``RuntimeStats.post_forward_bytes``, and the row's all-gathers in ``post_forward_all_gather_*``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._collectives import all_gather
from ._dbuffer import DBuffer
from ._mesh import MeshInfo
from ._metrics import RuntimeStats

__all__ = ["ReshardTo", "reshard_to"]


class ReshardTo:
    """The pieces a unit keeps after forward over rows of ``size`` ranks, and their group."""

    def __init__(self, info: MeshInfo, size: int) -> None:
        mesh = info.mesh
        rows = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, size))  # makes each row's group
        self.size = size
        self.group = rows.get_group(1)
        self.index = info.shard_rank % size  # this rank's place in its row
        self._pieces: list[torch.Tensor] | None = None

    @property
    def holding(self) -> bool:
        """Whether pieces are kept (between a forward and the backward that refills them)."""
        return self._pieces is not None

    def keep(self, buckets: list[DBuffer], stats: RuntimeStats) -> None:
        """Copy this rank's ``1/size`` of each gathered buffer (before the buffers are freed).
        A parameter held whole here reads its shard, not its slot of the buffer, so the slot
        is written first where the all-gather left it out (``DBuffer.own_ranges``)."""
        pieces = []
        for bucket in buckets:
            assert bucket.full is not None
            if bucket.own_ranges != [(0, bucket.shard_numel)]:
                mine = bucket.rank * bucket.shard_numel
                bucket.full[mine : mine + bucket.shard_numel].copy_(bucket.local)
                stats.add_copy(bucket.local)
            piece_numel = bucket.full_numel // self.size
            start = self.index * piece_numel
            pieces.append(bucket.full[start : start + piece_numel].clone())
            stats.add_copy(pieces[-1])
        self._pieces = pieces
        self._note(stats, _nbytes(pieces))

    def refill(
        self, buckets: list[DBuffer], stats: RuntimeStats, *, gloo_point_to_point: bool
    ) -> None:
        """All-gather the kept pieces over the row into the (allocated) buffers, and let them
        go."""
        assert self._pieces is not None
        for bucket, piece in zip(buckets, self._pieces, strict=True):
            assert bucket.full is not None
            all_gather(
                bucket.full,
                piece,
                self.group,
                stats,
                async_op=False,
                gloo_point_to_point=gloo_point_to_point,
            )
            stats.post_forward_all_gather_calls += 1
            stats.post_forward_all_gather_bytes += piece.numel() * piece.element_size()
        self.drop(stats)

    def drop(self, stats: RuntimeStats) -> None:
        """Let the kept pieces go (refilled, or stale: a step or a load changed the shards)."""
        if self._pieces is not None:
            self._note(stats, -_nbytes(self._pieces))
            self._pieces = None

    @staticmethod
    def _note(stats: RuntimeStats, delta: int) -> None:
        stats.note_unsharded(delta)
        stats.post_forward_bytes += delta


def _nbytes(pieces: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in pieces)


def reshard_to(value: bool | int | None, info: MeshInfo) -> tuple[bool | None, ReshardTo | None]:
    """``reshard_after_forward`` as the hooks take it (``True``, ``False`` or ``None``) and, for
    an int between 1 and the shard size, what keeps the pieces; checked as FSDP2 checks it: a
    factor of the shard size (``ValueError``), 1 meaning ``False`` and the shard size ``True``;
    refused over a mesh that does not span every rank (``NotImplementedError``)."""
    if value is None or isinstance(value, bool):
        return value, None
    size = info.shard_size
    if value < 1 or value > size or size % value:
        raise ValueError(
            f"If passing reshard_after_forward as an int, it should be a factor of {size}, not "
            f"{value} (raggedfsdp: the unit's shard group has {size} ranks)"
        )
    if value == 1:
        return False, None
    if value == size:
        return True, None
    if info.mesh.size() != dist.get_world_size():
        # Every rank makes every row's group (new_group), from its own unit's mesh: over a
        # sub-mesh (mesh["dp"] beside tensor parallelism) the ranks would make different ones.
        raise NotImplementedError(
            f"raggedfsdp: reshard_after_forward={value} over a mesh of {info.mesh.size()} of the "
            f"{dist.get_world_size()} ranks is not supported: the groups of {value} ranks are "
            f"made by every rank from its own mesh; use it where the unit's mesh spans every rank"
        )
    return True, ReshardTo(info, value)
