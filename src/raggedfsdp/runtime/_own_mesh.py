"""Per-parameter meshes: ``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult``.

torchtitan's ``apply_fsdp`` gives a block's routed experts a mesh of their own (the
expert-data-parallel mesh) through ``ShardPlacementResult(placement, mesh_info)``, the block's
other parameters the block's mesh. FSDP2 keeps one parameter group with parameters on two meshes;
here a unit shards over one mesh, so the modules whose parameters all ask for another mesh become a
unit of their own over it, first (bottom-up, as ``fully_shard(experts, mesh=...)`` would make
them), and the block's unit the rest: the same parameters, placements and numbers. FSDP2's mesh
info (``torch.distributed.fsdp``'s private ``FSDPMeshInfo`` / ``HSDPMeshInfo``: ``mesh``,
``shard_mesh_dim``, ``replicate_mesh_dim``) is read by its attributes, so this works with torches
that lack ``ShardPlacementResult`` (2.13) and with those that have it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

__all__ = ["OwnMeshUnit", "own_mesh_units", "placement_of"]


def placement_of(result: object) -> Placement | None:
    """The placement ``shard_placement_fn`` asked for: itself, or a ``ShardPlacementResult``'s."""
    return result.placement if _has_mesh(result) else result  # type: ignore[attr-defined,return-value]


def _has_mesh(result: object) -> bool:
    return hasattr(result, "mesh_info") and hasattr(result, "placement")


@dataclass(frozen=True)
class OwnMeshUnit:
    """Modules whose parameters all asked for ``mesh``: one unit over it, sharded as each
    parameter's result says (``shard_placement_fn`` for that unit)."""

    modules: list[nn.Module]
    mesh: DeviceMesh
    shard_placement_fn: Callable[[nn.Parameter], Placement | None]


def own_mesh_units(
    modules: list[nn.Module],
    params: list[tuple[str, nn.Parameter]],
    placement_fn: Callable[[nn.Parameter], Any],
    unit_mesh: DeviceMesh | None,
) -> list[OwnMeshUnit]:
    """The units of their own that ``placement_fn``'s results ask for among ``params`` (the
    unit's parameters, ``(name, parameter)``, in model order; inner units' and ignored ones left
    out) of ``modules``: for each mesh other than ``unit_mesh``, the outermost modules below
    ``modules`` whose parameters (of ``params``) all ask for it. A parameter whose module also
    holds parameters of another mesh is refused, naming it."""
    results = {id(p): placement_fn(p) for _, p in params}
    mesh_of: dict[int, DeviceMesh] = {}
    for name, param in params:
        result = results[id(param)]
        if _has_mesh(result):
            mesh = _mesh(name, result.mesh_info)  # type: ignore[union-attr]
            if unit_mesh is None or not (mesh is unit_mesh or mesh == unit_mesh):
                mesh_of[id(param)] = mesh
    if not mesh_of:
        return []
    mine = {id(p) for _, p in params}
    chosen: dict[int, list[nn.Module]] = {}  # id(mesh) -> its modules, outermost first
    meshes: dict[int, DeviceMesh] = {}
    covered: set[int] = set()
    for root in modules:
        for module in _outermost(root, mine, mesh_of):
            held = _held(module, mine)
            mesh = mesh_of[next(iter(held))]
            # equal meshes (FSDP2's mesh infos made apart, of one mesh) make one unit
            key = next((k for k, m in meshes.items() if m == mesh), id(mesh))
            chosen.setdefault(key, []).append(module)
            meshes.setdefault(key, mesh)
            covered |= held
    for name, param in params:
        if id(param) in mesh_of and id(param) not in covered:
            raise ValueError(
                f"shard_placement_fn gave parameter {name!r} a mesh of its own, but its module "
                f"also holds parameters of another mesh: raggedfsdp makes the modules whose "
                f"parameters all ask for one mesh a unit over it; give every parameter of that "
                f"module the same mesh, or move {name!r} into a module of its own"
            )
    units = []
    for key, group in chosen.items():
        held = {pid for module in group for pid in _held(module, mine)}
        units.append(
            OwnMeshUnit(
                group,
                meshes[key],
                lambda p, held=held: placement_of(results[id(p)]) if id(p) in held else None,
            )
        )
    return units


def _held(module: nn.Module, mine: set[int]) -> set[int]:
    """``id`` of the unit's parameters registered in ``module`` or below it."""
    return {id(p) for p in module.parameters() if id(p) in mine}


def _outermost(root: nn.Module, mine: set[int], mesh_of: dict[int, DeviceMesh]) -> list[nn.Module]:
    """The outermost modules below ``root`` (not ``root`` itself) whose parameters of the unit
    all ask for one mesh other than the unit's."""
    out = []
    for child in root.children():
        held = _held(child, mine)
        meshes = [mesh_of.get(p) for p in held]
        if held and meshes[0] is not None and all(m == meshes[0] for m in meshes):
            out.append(child)
        elif held:
            out.extend(_outermost(child, mine, mesh_of))
    return out


def _mesh(name: str, info: object) -> DeviceMesh:
    """The raggedfsdp mesh of FSDP2's mesh info: 1-D (shard), or 2-D (replicate, shard)."""
    mesh = getattr(info, "mesh", None)
    shard = getattr(info, "shard_mesh_dim", None)
    replicate = getattr(info, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"shard_placement_fn gave parameter {name!r} a mesh_info without a DeviceMesh "
            f"(got {type(info).__name__}); pass FSDP2's FSDPMeshInfo(mesh=..., shard_mesh_dim=0)"
        )
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"raggedfsdp: a per-parameter mesh in the full-SPMD-mesh form (dp_mesh_dims) for "
            f"parameter {name!r} is not supported: give its modules a unit of their own, "
            f"fully_shard(module, mesh=..., dp_mesh_dims=...)"
        )
    if (mesh.ndim, shard, replicate) in ((1, 0, None), (2, 1, 0)):
        return mesh
    raise ValueError(
        f"shard_placement_fn gave parameter {name!r} a mesh of {mesh.ndim} dims sharded on dim "
        f"{shard} and replicated on dim {replicate}: raggedfsdp shards over a 1-D mesh "
        f"(shard_mesh_dim=0) or a 2-D (replicate, shard) one (replicate_mesh_dim=0, "
        f"shard_mesh_dim=1)"
    )
