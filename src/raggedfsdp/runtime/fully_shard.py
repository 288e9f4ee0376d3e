"""``fully_shard`` / ``FSDPBackend``: shard a module in place, and the methods it then has.

``fully_shard`` builds one :class:`~._param_group.FSDPParamGroup` (the unit's buckets and
buffers) and one :class:`~._hooks.FSDPState` (its hooks) per module, and extends the module's
class with :class:`FSDPModule`, as FSDP2 does, so ``state_dict()`` keys are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from ..facts import check_cut
from ..layout import RaggedShard
from ..planner import StructAwarePlanner, WrapPolicy, wrap_units
from ._adopt import materialize
from ._collectives import all_gather
from ._fsdp_module import (
    FSDPModule,
    UnshardHandle,
    check_reshard_after_forward,
    fsdp_class,
    unsupported,
)
from ._hooks import FSDPState, state_of, states_under
from ._mesh import MeshInfo, device_for, mesh_info, parallel_spec
from ._metrics import RuntimeStats
from ._offload import HostOffload, check_host_backend, offload_for
from ._own_mesh import own_mesh_units, placement_of
from ._param import Registration
from ._param_placement import DimShard, FullMesh, ParamPlacement, Plain, SubMesh, split_placement
from ._reshard_to import reshard_to
from ._spmd import DataParallelMeshDims, spmd_mesh, spmd_param
from ._subclass import unit_group
from ._torch_fsdp import adapt_torch
from ._torch_state import expose_to_torch, torch_facing_state
from .api import CommCompression, DBufferConfig, MixedPrecisionPolicy

__all__ = [
    "FSDPBackend",
    "FSDPModule",
    "UnshardHandle",
    "full_parameters",
    "fully_shard",
    "materialize_shards_",
]


def materialize_shards_(model: nn.Module) -> None:
    """Give every unit under ``model`` whose shards are still on the meta device (it was built
    there) zeros on its device, for the caller to fill (``rf.init_sharded_``; ``to_empty``
    does the same for the whole model, as with FSDP2)."""
    for state in states_under(model):
        materialize(state.group)


def full_parameters(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(sharded parameter) -> full parameter on CPU`` for every unit under ``model``; a
    collective (every rank calls it, between steps)."""
    full: dict[int, torch.Tensor] = {}
    for state in states_under(model):
        for bucket in state.group.buckets:
            gathered = torch.empty(bucket.full_numel, dtype=bucket.dtype, device=bucket.device)
            shard = bucket.local.to(bucket.device)  # itself, unless offloaded to the host
            group = state.group.mesh_info.shard_group
            all_gather(gathered, shard, group, RuntimeStats(), async_op=False)
            for param in bucket.params:
                piece = gathered[param.offset : param.offset + param.numel].view(param.shape)
                piece = param.placement.whole(piece)
                full[id(param.sharded)] = piece.detach().to("cpu", copy=True)
    return full


def _resolve_planner(
    shard_policy: RaggedShard | None,
    planner: StructAwarePlanner | None,
    compression: CommCompression | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
) -> StructAwarePlanner:
    """The planner to shard with, checked against the other arguments (before any collective)."""
    if planner is None:
        planner = StructAwarePlanner(shard_policy=shard_policy, compression=compression)
    if shard_policy is not None and shard_policy != planner.shard_policy:
        raise ValueError(
            f"shard_policy={shard_policy!r} differs from the planner's policy "
            f"{planner.shard_policy!r}; pass one of them"
        )
    if compression is not None and compression.enabled and compression != planner.compression:
        # The planner's units must keep this compression's blocks whole.
        raise ValueError(
            f"compression={compression!r} differs from the planner's "
            f"({planner.compression!r}); pass StructAwarePlanner(..., compression=...) too"
        )
    _check_reduce_dtype(mp_policy, planner.compression)
    return planner


def _check_fsdp2_arguments(
    module: object, reshard_after_forward: object, offload_policy: object
) -> list[nn.Module]:
    """FSDP2's arguments that have no meaning here: a clear error, before any collective.
    Returns the modules to shard as one unit: ``module``, or the outermost of a list of them
    (FSDP2's group: one parameter group for modules that run one after the other)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs a module, or a non-empty list of modules")
    for item in modules:
        if not isinstance(item, nn.Module):
            raise TypeError(
                f"rf.fully_shard takes an nn.Module or a list of them, got {type(item).__name__}"
            )
        if isinstance(item, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward "
                f"({type(item).__name__}): its hooks would never run, so its parameters would "
                f"never be gathered; shard each of its modules, pass them as a list, or shard "
                f"the module that calls them"
            )
        if state_of(item) is not None:
            # AssertionError, with FSDP2's words: what FSDP2's callers expect
            raise AssertionError(
                f"Each distinct composable distributed API can only be applied to a module "
                f"once: {type(item).__name__} is already sharded by raggedfsdp (fully_shard was "
                f"applied to it twice)"
            )
    check_reshard_after_forward(reshard_after_forward)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be a torch.distributed.fsdp OffloadPolicy, got "
            f"{type(offload_policy).__name__}"
        )
    # Modules inside another of the list belong to it already, as FSDP2 takes them.
    unique = list({id(m): m for m in modules}.values())
    inner = {id(sub) for m in unique for sub in m.modules() if sub is not m}
    return [m for m in unique if id(m) not in inner]


def _offload(
    offload_policy: OffloadPolicy | None,
    device: torch.device,
    config: DBufferConfig,
    compression: CommCompression | None,
    info: MeshInfo,
) -> HostOffload | None:
    """What a ``CPUOffloadPolicy`` asks on ``device`` (``_offload.py``: nothing more on CPU
    unless ``config.host_copies_on_cpu``); refused with a compressed all-gather, which quantizes
    the shard where it lies, and over groups that cannot reduce host tensors."""
    offload = offload_for(offload_policy, device, host_copies_on_cpu=config.host_copies_on_cpu)
    if offload is None:
        return None
    check_host_backend([g for g in (info.shard_group, info.replicate_group) if g])
    if compression is not None and compression.all_gather is not None:
        unsupported(
            f"offload_policy=CPUOffloadPolicy() with CommCompression(all_gather="
            f"{compression.all_gather})",
            "the quantized all-gather encodes the shard where it lives, which offload puts on "
            "the host; keep compression for the reduce-scatter only (all_gather=None), or drop "
            "the offload",
        )
    return offload


def _check_reduce_dtype(
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None,
    compression: CommCompression | None,
) -> None:
    """A compressed reduce-scatter sums the dequantized codes in fp32 and yields an fp32 shard
    (docs/design.md): any explicit ``reduce_dtype`` but fp32 would be ignored, so it is refused
    (``None`` and fp32 say what happens anyway)."""
    if compression is None or compression.reduce_scatter is None:
        return
    mp = MixedPrecisionPolicy.of(mp_policy)
    if mp.reduce_dtype is None or mp.reduce_dtype == torch.float32:
        return
    raise ValueError(
        f"mp_policy.reduce_dtype={mp.reduce_dtype} conflicts with "
        f"CommCompression(reduce_scatter={compression.reduce_scatter}): a compressed "
        f"reduce-scatter moves {compression.reduce_scatter} codes and sums them in fp32, so "
        f"there is no {mp.reduce_dtype} reduction; set reduce_dtype=None or torch.float32, or "
        f"reduce_scatter=None to reduce in {mp.reduce_dtype}"
    )


def _requested_dims(
    registrations: list[Registration],
    placement_fn: Callable[[nn.Parameter], Placement | None] | None,
) -> dict[str, int]:
    """``fqn -> dim`` for each parameter ``shard_placement_fn`` asks ``Shard(dim)`` for, ``dim``
    made non-negative as FSDP2 does (``Shard(-1)``: the last); ``Shard(0)`` and ``None`` are the
    ragged default and left out. Refused as FSDP2 refuses them: a dim the parameter lacks."""
    if placement_fn is None:
        return {}
    dims = {}
    for registration in registrations:
        # a ShardPlacementResult of the unit's own mesh here: the others made units of their own
        placement = placement_of(placement_fn(registration.param))
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise AssertionError(  # FSDP2's check's type and words (it reads .dim first)
                f"Expected Shard, got {type(placement).__name__}: shard_placement_fn must "
                f"return a Shard placement or None, got {placement!r} for parameter "
                f"{registration.fqn!r}"
            )
        ndim = max(registration.param.dim(), 1)
        if not -ndim <= placement.dim < ndim:
            # AssertionError, as FSDP2 raises it (its callers' tests expect the type)
            raise AssertionError(
                f"Shard dim {placement.dim} is invalid for {registration.param.dim()}D tensor: "
                f"shard_placement_fn asked {placement!r} for parameter {registration.fqn!r} of "
                f"shape {list(registration.param.shape)}"
            )
        if placement.dim % ndim:
            dims[registration.fqn] = placement.dim % ndim
    return dims


# Set on an original parameter once a unit has sharded it: another unit that still finds it (a
# parameter tied across units) would shard a second, independent copy of the freed original.
_SHARDED_BY = "_raggedfsdp_sharded_by"


def _become_unit(registrations: list[Registration], modules: list[nn.Module]) -> None:
    """Mark the unit's original parameters sharded and extend its modules' classes with
    :class:`FSDPModule`, which torch's utilities then take (adapted once, :func:`adapt_torch`)."""
    adapt_torch()
    unit = " + ".join(type(m).__name__ for m in modules)
    for registration in registrations:
        setattr(registration.param, _SHARDED_BY, f"{unit} (as {registration.fqn!r})")
    for module in modules:
        if not isinstance(module, FSDPModule):
            module.__class__ = fsdp_class(type(module))


def _registrations(modules: list[nn.Module], ignored: set[nn.Parameter]) -> list[Registration]:
    """Parameters of ``modules`` not managed by an inner unit nor ignored, each with every place
    it is registered (tied parameters have several), in model order; named below their module,
    and ``i.``-prefixed by its index when the unit has several."""
    managed: set[int] = {id(p) for p in ignored}
    for module in modules:
        for sub in module.modules():
            state = state_of(sub)
            if sub is not module and state is not None:
                managed.update(id(p) for p in state.group.sharded_parameters())
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for index, module in enumerate(modules):
        prefix = f"{index}." if len(modules) > 1 else ""
        for mname, sub in module.named_modules(remove_duplicate=False):
            for pname, param in sub._parameters.items():
                if param is None or id(param) in managed:
                    continue
                fqn = f"{prefix}{mname}.{pname}" if mname else f"{prefix}{pname}"
                owners = found.setdefault(id(param), (fqn, param, []))[2]
                if (sub, pname) not in owners:
                    owners.append((sub, pname))
    for fqn, param, _ in found.values():
        _check_parameter(fqn, param, modules)
    return [Registration(fqn, param, tuple(owners)) for fqn, param, owners in found.values()]


def _unit_mesh(
    registrations: list[Registration],
    mesh: DeviceMesh | None,
    dp_mesh_dims: object | None,
    device: torch.device,
    policy: RaggedShard,
    dims: dict[str, int],
) -> tuple[list[Registration], MeshInfo]:
    """The mesh the unit shards over, and ``registrations`` with how each parameter is split
    over its other (tensor- or expert-parallel) dims and, where ``dims`` names it, along which
    dim it is sharded (FSDP2's ``Shard(dim)``), each checked against the shard policy's units;
    under ``dp_mesh_dims`` with its place on the whole mesh too, every parameter checked
    before the data-parallel dims are flattened (which makes process groups)."""
    if dp_mesh_dims is None:
        info = mesh_info(mesh, device)
        placed = []
        for r in registrations:
            placement: ParamPlacement = split_placement(parallel_spec(r.fqn, r.param, info.mesh))
            if r.fqn in dims:
                placement = _dim_shard(r, dims[r.fqn], placement, info, policy)
            placed.append(_placed(r, placement))
        for registration in placed:
            _check_parallel_cuts(registration, policy)
        return placed, info
    if dims:
        unsupported(
            f"shard_placement_fn asking Shard(dim > 0) for {sorted(dims)} with dp_mesh_dims",
            "the full-SPMD-mesh form shards every parameter on dim 0; leave it to the "
            "default (None or Shard(0))",
        )
    spmd = spmd_mesh(mesh, dp_mesh_dims)
    placed = []
    for registration in registrations:
        whole, split = spmd_param(registration.fqn, registration.param, spmd)
        placed.append(_placed(registration, FullMesh(whole, split_placement(split))))
    for registration in placed:  # before flattening the data-parallel dims makes groups
        _check_parallel_cuts(registration, policy)
    return placed, mesh_info(spmd.data_parallel_mesh(), device)


def _dim_shard(
    registration: Registration,
    dim: int,
    inner: Plain | SubMesh,
    info: MeshInfo,
    policy: RaggedShard,
) -> DimShard:
    """FSDP2's ``Shard(dim)`` for one parameter, its even split checked against the shard
    policy's blocks, as a tensor-parallel split is (:mod:`raggedfsdp.facts.cuts`)."""
    local = inner.local(registration.param)
    split = inner.split
    if split is not None and any(
        isinstance(p, Shard) and p.dim % local.dim() == dim for p in split.placements
    ):
        unsupported(
            f"Shard({dim}) from shard_placement_fn for parameter {registration.fqn!r}, which "
            f"tensor or expert parallelism splits along dim {dim} already",
            "shard it along another dim, or leave it to the default (Shard(0))",
        )
    by = f"Shard({dim}) (shard_placement_fn) over {info.shard_size} ranks"
    check_cut(registration.fqn, tuple(local.shape), dim, info.shard_size, policy, by=by)
    return DimShard(dim, inner)


def _shard_own_meshes(
    modules: list[nn.Module],
    placement_fn: Callable[[nn.Parameter], Any],
    *,
    mesh: DeviceMesh | None,
    ignored_params: set[nn.Parameter] | None,
    **kwargs: Any,
) -> None:
    """Parameters ``placement_fn`` gives meshes of their own (FSDP2's ``ShardPlacementResult``):
    their modules made units over those meshes first, bottom-up, with the call's other
    arguments (``kwargs``) and each parameter's placement (``_own_mesh.py``)."""
    params = [(r.fqn, r.param) for r in _registrations(modules, ignored_params or set())]
    for own in own_mesh_units(modules, params, placement_fn, mesh):
        fully_shard(
            own.modules if len(own.modules) > 1 else own.modules[0],
            mesh=own.mesh,
            shard_placement_fn=own.shard_placement_fn,
            ignored_params=ignored_params,
            **kwargs,
        )


def _placed(registration: Registration, placement: ParamPlacement) -> Registration:
    return dataclasses.replace(registration, placement=placement)


def _check_parallel_cuts(registration: Registration, policy: RaggedShard) -> None:
    """A DTensor parameter's tensor- or expert-parallel split must not cut a block the policy
    keeps whole (:mod:`raggedfsdp.facts.cuts`, the rule the capacity planner applies too): one
    error naming the parameter, its split and its block, before any collective."""
    spec = registration.placement.split
    if spec is None:
        return
    shape = tuple(spec.shape)
    for dim, placement in enumerate(spec.placements):
        if isinstance(placement, Shard):
            ways = spec.mesh.size(dim)
            by = f"{placement!r} over {ways} ranks"
            check_cut(registration.fqn, shape, placement.dim % len(shape), ways, policy, by=by)


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """The unit's buffers (not an inner unit's) on its device, as FSDP2 moves them: a model
    built on the CPU and sharded over a GPU mesh computes on the GPU."""
    for module in modules:
        for sub in module.modules():
            if sub is not module and state_of(sub) is not None:
                continue  # an inner unit moved its own
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.device.type != "meta" and buffer.device != device:
                    sub._buffers[name] = buffer.to(device)


def _check_parameter(fqn: str, param: nn.Parameter, modules: list[nn.Module]) -> None:
    sharded_by = getattr(param, _SHARDED_BY, None)
    if sharded_by is not None:
        raise ValueError(
            f"parameter {fqn!r} of {type(modules[0]).__name__} was sharded already by the unit "
            f"{sharded_by}: it is tied across units (registered in both); shard a module that "
            f"holds every place it is registered, such as their common parent, or shard the "
            f"modules together (fully_shard([a, b]))"
        )
    if not param.is_contiguous():
        raise NotImplementedError(  # FSDP2's type and words
            f"FSDP does not support non-contiguous parameters yet: parameter {fqn!r} of shape "
            f"{list(param.shape)} is not contiguous; make it contiguous before fully_shard"
        )


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_policy: RaggedShard | None = None,
    planner: StructAwarePlanner | None = None,
    dbuffer_config: DBufferConfig | None = None,
    compression: CommCompression | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters (those not in an inner ``fully_shard``-ed module) over the
    mesh, in place; returns the same object with its class extended by :class:`FSDPModule`
    (a subclass of torch's). A list of modules becomes one unit, as in FSDP2: one parameter
    group, gathered when the first of them starts its forward and freed when the last ends
    (``fully_shard([model.norm, model.output])``); the list is returned.

    Apply it bottom-up: to each block, then to the root. FSDP2's arguments keep FSDP2's meanings
    (docs/migrating-from-fsdp2.md): ``reshard_after_forward`` frees the unsharded parameters after
    forward (``None``: yes, but not the root's; an int ``N``: sharded over groups of ``N`` ranks,
    which backward all-gathers within, as FSDP2's); the unit that runs forward last keeps them into
    backward, which starts with it. ``mesh`` is 1-D (shard) or 2-D (replicate, shard: HSDP);
    ``None`` shards over the whole default group. ``shard_placement_fn`` returns ``None`` or
    ``Shard(0)`` for the ragged shards (runs of whole units in row-major order, the units chosen
    with ``shard_policy``), or ``Shard(dim)`` (``dim > 0`` or negative) for FSDP2's even split along
    ``dim``: that parameter is a bucket of its own and a DTensor placed ``Shard(dim)``; or FSDP2's
    ``ShardPlacementResult(placement, mesh_info)``, whose modules on a mesh other than ``mesh``
    become units of their own over it (torchtitan's experts, ``_own_mesh.py``).
    ``offload_policy``: a ``CPUOffloadPolicy`` is met as is on CPU (unless
    ``DBufferConfig.host_copies_on_cpu``); on an accelerator shards, gradients and optimizer state
    live on the host (not with a compressed all-gather). ``ignored_params`` stay unsharded and
    unmanaged, as in FSDP2. ``compression`` quantizes the all-gather and/or the reduce-scatter by
    blocks (:class:`CommCompression`; a ``planner`` given too must carry the same one,
    ``mp_policy.reduce_dtype`` None or fp32 under a compressed reduce-scatter). With
    ``dp_mesh_dims`` (FSDP2's full-SPMD-mesh form, ``_spmd.py``) ``mesh`` is the whole mesh, its
    leading dims the data-parallel ones named, and every parameter a DTensor on it."""
    modules = _check_fsdp2_arguments(module, reshard_after_forward, offload_policy)
    planner = _resolve_planner(shard_policy, planner, compression, mp_policy)
    if shard_placement_fn is not None:
        _shard_own_meshes(
            modules,
            shard_placement_fn,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
            planner=planner,
            dbuffer_config=dbuffer_config,
        )
    registrations = _registrations(modules, ignored_params or set())
    dims = _requested_dims(registrations, shard_placement_fn)
    if dims and planner.compression is not None and planner.compression.enabled:
        unsupported(
            f"shard_placement_fn asking Shard(dim > 0) for {sorted(dims)} with compression",
            "the quantization blocks follow the parameter's rows; leave the placement to the "
            "default (None or Shard(0)) or drop the compression",
        )
    device = device_for([r.param for r in registrations], mesh)
    registrations, info = _unit_mesh(
        registrations, mesh, dp_mesh_dims, device, planner.shard_policy, dims
    )
    config = dbuffer_config or DBufferConfig()
    offload = _offload(offload_policy, device, config, planner.compression, info)
    group = unit_group(
        registrations,
        mesh_info=info,
        planner=planner,
        config=config,
        mp_policy=MixedPrecisionPolicy.of(mp_policy),
        device=device,
        module_name=" + ".join(type(m).__name__ for m in modules),
        compression=planner.compression,
        offload=offload,
    )
    _move_buffers(modules, device)
    reshard_after_forward, group.reshard_to = reshard_to(reshard_after_forward, info)
    expose_to_torch(FSDPState(modules, group, reshard_after_forward))
    _become_unit(registrations, modules)
    return module


# FSDP2's ``fully_shard.state(module)``: what torch's own lookup returns for a raggedfsdp module.
fully_shard.state = torch_facing_state  # type: ignore[attr-defined]


def FSDPBackend(
    module: nn.Module,
    *,
    shard_policy: RaggedShard | None = None,
    dbuffer_config: DBufferConfig | None = None,
    planner: StructAwarePlanner | None = None,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = True,
    wrap: WrapPolicy = None,
    compression: CommCompression | None = None,
) -> FSDPModule:
    """Shard a whole model: every block (each element of an ``nn.ModuleList``, or each module
    for which ``wrap(module)`` is true) bottom-up, then the root. Returns the same object; its
    buckets are exactly ``planner.plan_model(module, W, buffer_size=..., dtype=param_dtype,
    wrap=wrap)``; ``compression`` as in :func:`fully_shard`."""
    planner = _resolve_planner(shard_policy, planner, compression, mp_policy)
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "planner": planner,
        "dbuffer_config": dbuffer_config,
    }
    # Bottom-up, in the one order plan_model uses: inner blocks before the modules containing them.
    for _, block in wrap_units(module, wrap)[:-1]:
        if state_of(block) is None:
            fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    return fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)
