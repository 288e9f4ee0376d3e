"""The parallel degrees of a run: one noun, as torchtitan's ``ParallelDims`` names them.

``world = dp_replicate x dp_shard x cp x tp x pp``, ``tp`` innermost; expert parallelism borrows its
ranks from ``dp_shard`` (torchtitan's ``etp = tp``). ``dp_shard=-1`` takes whatever ranks the others
leave, so one noun serves before a world size is known and after (:meth:`ParallelDims.at_world`).
What is and is not modelled: the comment at :class:`ParallelDims`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ParallelDims"]

#: The degrees, in the order a message names them (torchtitan's, ``dp_shard`` resolved last).
_FIXED = ("dp_replicate", "cp", "tp", "pp", "ep")


def _positive(name: str, value: object, *, auto: bool = False) -> None:
    if auto and value == -1 and not isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = " (or -1: the ranks the others leave)" if auto else ""
        raise ValueError(f"{name} must be a positive integer{also}, got {value!r}")


# ``world = dp_replicate x dp_shard x cp x tp x pp``, with ``tp`` innermost (consecutive ranks,
# inside a node). Expert parallelism borrows its ranks from ``dp_shard`` (torchtitan's ``etp = tp``:
# experts are tensor-parallel over ``tp`` as the dense layers are): dense parameters are
# FSDP-sharded over ``dp_shard`` ranks, routed experts over ``dp_shard / ep``
# (:attr:`ParallelDims.dp_shard_mod_ep`, torchtitan's mesh dim of that name). ``dp_shard=-1`` (the
# default, as torchtitan's) takes whatever ranks the others leave, so one noun serves both before a
# world size is known (the capacity planner costs many) and after (:meth:`ParallelDims.at_world`).
#
# torchtitan lets ``ep`` borrow from ``cp`` too, and has ``etp = 1`` (experts not tensor-parallel,
# ``ep`` borrowing the ``tp`` ranks); neither is modelled here. ``pp`` is outermost (the job's
# ``--pp`` mesh, ``train/mesh.py``); ``cp`` a run may state, nothing in raggedfsdp splits by it yet.
@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How a run's ranks are split (module doc).

    Attributes:
        dp_replicate: replicas of the data-parallel shards (HSDP's replicate dim).
        dp_shard: ranks each parameter is FSDP-sharded over; ``-1``: what the world leaves
            (:meth:`at_world` resolves it).
        cp: context-parallel ranks (stated, not modelled).
        tp: tensor-parallel ranks, innermost.
        pp: pipeline ranks, outermost.
        ep: expert-parallel ranks, borrowed from ``dp_shard``.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in _FIXED:
            _positive(name, getattr(self, name))
        _positive("dp_shard", self.dp_shard, auto=True)
        if self.resolved and self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp_shard={self.dp_shard}: expert parallelism "
                f"borrows its ranks from the data-parallel shard ranks; use an ep that divides "
                f"{self.dp_shard}"
            )

    @property
    def resolved(self) -> bool:
        """Whether ``dp_shard`` is known (a world size was given)."""
        return self.dp_shard != -1

    @property
    def model_parallel(self) -> int:
        """The degrees that split parameters: ``tp x ep`` (1: every rank holds whole ones)."""
        return self.tp * self.ep

    @property
    def world_multiple(self) -> int:
        """What every world size must be a multiple of: the fixed degrees' product (``ep``
        among them, since ``dp_shard`` must be a multiple of it)."""
        product = 1
        for name in _FIXED:
            product *= getattr(self, name)
        return product

    def at_world(self, world_size: int) -> ParallelDims:
        """These degrees over ``world_size`` ranks, ``dp_shard`` resolved.

        Raises:
            ValueError: a world size the degrees do not divide, naming them; one other than
                the degrees' own when ``dp_shard`` was given.
        """
        _positive("world size", world_size)
        if self.resolved:
            if world_size != self.world_size:
                raise ValueError(
                    f"{self} spans {self.world_size:,} ranks, not the world size {world_size:,}"
                )
            return self
        if world_size % self.world_multiple:
            terms = [
                f"{n}={getattr(self, n)}"
                for n in _FIXED
                if n in ("tp", "ep") or getattr(self, n) != 1
            ]
            raise ValueError(
                f"{' x '.join(terms)} = {self.world_multiple} does not divide the world size "
                f"{world_size:,}: the ranks form a {self._mesh_text()} mesh; use a world size "
                f"that is a multiple of {self.world_multiple}"
            )
        rest = self.dp_replicate * self.cp * self.tp * self.pp
        return dataclasses.replace(self, dp_shard=world_size // rest)

    def _mesh_text(self) -> str:
        """The mesh's dims, outermost first: ``dp``, ``ep`` and ``tp`` always, the others
        where stated (``pp x dp x ep x tp``)."""
        order = ("pp", "dp_replicate", "dp", "cp", "ep", "tp")
        return " x ".join(n for n in order if n in ("dp", "ep", "tp") or getattr(self, n) != 1)

    def check_world(self, world_size: int) -> None:
        """:meth:`at_world`'s checks alone."""
        self.at_world(world_size)

    def _need_world(self, what: str) -> None:
        if not self.resolved:
            raise ValueError(
                f"{what} of {self} needs a world size: dp_shard=-1 takes the ranks the others "
                f"leave; call at_world(world_size) first"
            )

    @property
    def world_size(self) -> int:
        """Ranks in the run: ``dp_replicate x dp_shard x cp x tp x pp``."""
        self._need_world("world_size")
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Ranks that read sequences of their own: ``dp_replicate x dp_shard`` (``ep`` borrows
        from them, ``tp`` ranks share theirs)."""
        self._need_world("dp")
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks a routed expert is FSDP-sharded over: ``dp_shard / ep`` (every parameter's
        without expert parallelism)."""
        self._need_world("dp_shard_mod_ep")
        return self.dp_shard // self.ep

    def __str__(self) -> str:
        shard = "auto" if not self.resolved else str(self.dp_shard)
        named = [f"dp_shard={shard}"]
        named += [f"{n}={getattr(self, n)}" for n in _FIXED if getattr(self, n) != 1]
        return f"ParallelDims({', '.join(named)})"
