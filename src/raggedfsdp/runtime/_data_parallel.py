"""The data-parallel ranks of a root, over which every gradient is averaged.

Units under one root may shard over different meshes (experts beside dense units); the root's
data-parallel ranks are the union of its units' meshes, every trainable parameter must cover them,
and gradients are averaged over all of them ([Note: units on different meshes] at
:func:`data_parallel_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Shard

from ._mesh import dim_ranks, mesh_ranks
from ._param import FSDPParam, qualified_name
from ._param_group import FSDPParamGroup

__all__ = ["data_parallel_ranks"]


# [Note: units on different meshes] Units under one root may shard over different meshes. Beside
# expert parallelism (torchtitan's layout: ep borrows its ranks from data parallelism) the dense
# units shard over the ranks of ``dp`` and ``ep`` flattened into one dim, while the experts --
# DTensors ``Shard(0)`` over ``mesh["ep"]`` -- shard over ``mesh["dp"]`` only. Every rank some unit
# treats as data-parallel holds other data, so the root's *data-parallel ranks* are the union of its
# units' meshes (this rank's slices of them). A gradient reaches all of them in two ways: the unit's
# reduction, over its mesh, and, for a parameter split over dims that lie among those ranks, the
# model's own communication (the token dispatch's all-to-all brings every ep rank's tokens to the
# rank that holds an expert, and in backward their gradients). So each trainable parameter must
# cover them: its unit's ranks times the ranks of each dim it is ``Shard``-ed over inside them must
# be all of them. A parameter that does not -- a plain parameter in a unit sharded over
# ``mesh["dp"]`` beside a ``(dp, ep)`` root, an expert unit whose mesh is too small -- would see the
# gradients of part of the data only and its replicas would drift apart. Over data-parallel ranks
# only whole experts may be split (``Shard(0)``, as torchtitan places them over ep): a slice of
# every expert on each rank would compute with that rank's tokens only. Either is one error naming
# the parameter, at the root's first forward, before any collective.
#
# Gradients are then averaged over all the data-parallel ranks (the default divide factor is their
# number): a unit's reduction averages over its mesh and the reduced shard is scaled by its ranks /
# that number, so ``dp x ep`` ranks and one process on the global batch take the same step. FSDP2
# divides by each unit's own mesh, which leaves expert gradients ``ep`` times too large; torchtitan
# sets their factor by hand (``set_gradient_divide_factor``), as one may here, with the same result.
# A tensor-parallel dim holds the same data on all its ranks and lies outside the data-parallel
# ranks, so nothing changes beside TP.
def data_parallel_ranks(units: list[tuple[list[str], FSDPParamGroup]]) -> int:
    """How many data-parallel ranks the units under one root have together (``(paths below
    the root, group)`` each): the number their gradients are averaged over. Raises, naming it,
    for a trainable parameter whose gradient would not reach all of them, or that is split over
    them other than by whole experts (above). No collective."""
    ranks = [mesh_ranks(group.mesh_info.mesh) for _, group in units]
    world = frozenset().union(*ranks)
    widest = units[max(range(len(units)), key=lambda i: len(ranks[i]))]
    for (paths, group), unit_ranks in zip(units, ranks, strict=True):
        where = _Where(paths, group, widest, len(world))
        for param in group.params:
            if not param.sharded.requires_grad:
                continue
            covered, split = _covered(param, len(unit_ranks), world, where)
            if covered != len(world):
                raise ValueError(where.message(param, split, covered))
    return len(world)


def _covered(
    param: FSDPParam, unit_ranks: int, world: frozenset[int], where: _Where
) -> tuple[int, list[str]]:
    """Over how many data-parallel ranks ``param``'s gradient is combined: its unit's, times
    the data-parallel ranks of each dim it is ``Shard``-ed over, whose names come second. Only
    whole experts -- ``Shard(0)`` -- may be split over data-parallel ranks: a rank computes
    with its own tokens, so a slice of every expert there would see only part of the data
    (torchtitan places experts ``Shard(0)`` over ep, and splits them otherwise over tp only)."""
    covered, split = unit_ranks, []
    spec = param.placement.split
    if spec is None:
        return covered, split
    names = spec.mesh.mesh_dim_names or ()
    for dim, placement in enumerate(spec.placements):
        inside = dim_ranks(spec.mesh, dim) & world
        if not isinstance(placement, Shard) or len(inside) <= 1:
            continue
        name = names[dim] if dim < len(names) else str(dim)
        if placement.dim % len(spec.shape) != 0:
            raise ValueError(where.not_experts(param, name))
        covered *= len(inside)
        split.append(name)
    return covered, split


@dataclass(frozen=True)
class _Where:
    """A unit whose parameter falls short, and the widest unit beside it, for the error."""

    paths: list[str]
    group: FSDPParamGroup
    widest: tuple[list[str], FSDPParamGroup]
    world: int

    @property
    def unit(self) -> str:
        """The unit, as errors name it."""
        return f"the unit at {self.paths[0] or '<root>'!r}"

    def message(self, param: FSDPParam, split: list[str], covered: int) -> str:
        """The error for ``param``, whose gradient reaches ``covered`` of the ranks."""
        mesh = self.group.mesh_info.mesh
        name = qualified_name(param.fqn, self.paths)
        spec = param.placement.split
        placed = "" if spec is None else f" placed {spec.placements}"
        over = f" and split over {tuple(split)}" if split else ""
        wide_paths, wide = self.widest
        return (
            f"parameter {name!r}{placed} is sharded over mesh "
            f"{mesh.mesh_dim_names or tuple(mesh.shape)}{over} by {self.unit}: its gradient "
            f"would combine the data of {covered} ranks, but the data-parallel ranks under this "
            f"root are {self.world} (the unit at {wide_paths[0] or '<root>'!r} shards over mesh "
            f"{wide.mesh_info.mesh.mesh_dim_names or tuple(wide.mesh_info.mesh.shape)}), so its "
            f"replicas would drift apart. Shard it over the same mesh as the rest or, for an "
            f"expert, place it over the remaining dims first (distribute_tensor(weight, "
            f"mesh['ep'], [Shard(0)]), then fully_shard(experts, mesh=mesh['dp'])) so that "
            f"dp x ep covers them"
        )

    def not_experts(self, param: FSDPParam, dim_name: str) -> str:
        """The error for ``param``, split on a dim other than 0 over data-parallel ranks."""
        spec = param.placement.split
        assert spec is not None
        name = qualified_name(param.fqn, self.paths)
        return (
            f"parameter {name!r} of shape {list(spec.shape)} (in {self.unit}) is placed "
            f"{spec.placements} over mesh dim {dim_name!r}, whose ranks hold different data "
            f"(other units under this root shard over them, data-parallel): over those only "
            f"whole experts may be split, Shard(0) of weights stored [experts, ...] (as "
            f"torchtitan's expert parallelism places them); split other dims over a "
            f"tensor-parallel dim"
        )
