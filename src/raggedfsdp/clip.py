"""Gradient clipping by the GLOBAL norm over sharded and unsharded parameters.

``torch.nn.utils.clip_grad_norm_`` on local shards would scale each rank by its own pieces' norm.
Here sharded parameters contribute ``sum |g|^p`` of their local pieces, summed by ONE all-reduce per
shard group (``MAX`` for the infinity norm) and over the mesh dims tensor or expert parallelism cuts
a DTensor on (where torch's own cannot mix DTensors of several meshes); unsharded parameters are
held whole by every rank and counted once, locally.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from .tensor import comm_group, local_piece

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients in place so that their global ``norm_type``-norm is at most ``max_norm``.

    torch's semantics and signature; the norm is that of the full (unsharded) gradients, the same
    on every rank, and every rank of a shard group must call this with the same parameters (it is
    a collective). ``norm_type`` is a positive number or ``inf``. Under pipeline parallelism pass
    each rank's stage parameters and the 1-D ``pp_mesh`` over the stages (torchtitan's argument):
    the stages' norms are reduced over it, so every stage clips by the whole model's norm.

    Returns:
        The total norm of the gradients (before clipping), as a scalar tensor.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if not (norm_type > 0 or norm_type == math.inf) or math.isnan(norm_type):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type}")
    if pp_mesh is not None and pp_mesh.ndim != 1:
        raise ValueError(
            f"pp_mesh must be the 1-D mesh over the pipeline stages, got {pp_mesh.ndim} dims"
        )
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad and pp_mesh is None:
        return torch.tensor(0.0)
    total = _total_norm(with_grad, norm_type, foreach)
    if pp_mesh is not None:
        total = _over_stages(total, norm_type, pp_mesh)
    if error_if_nonfinite and not bool(total.isfinite()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            f"so it cannot be clipped. To disable this error and scale the gradients by the "
            f"non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    # torch's foreach ops refuse a list that mixes DTensors with plain tensors: one call each.
    for same_kind in (
        [p for p in with_grad if isinstance(p.grad, DTensor)],
        [p for p in with_grad if not isinstance(p.grad, DTensor)],
    ):
        if same_kind:
            clip_grads_with_norm_(same_kind, max_norm, total, foreach)
    return total


def _total_norm(
    with_grad: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """The global norm of the gradients of ``with_grad`` (a collective over their groups)."""
    if not with_grad:  # a stage with no gradients still joins the reduction over the stages
        return torch.tensor(0.0)
    dtype = with_grad[0].grad.dtype
    device = with_grad[0].grad.device
    for p in with_grad[1:]:
        dtype = torch.promote_types(dtype, p.grad.dtype)
    # Norms of the parts that are complete on this rank, and per shard group the global one.
    plain, groups = _split_by_group(with_grad)
    norms = [get_total_norm(plain, norm_type, foreach=foreach)] if plain else []
    norms += [
        _group_norm(over, grads, norm_type, device, foreach) for over, grads in groups.values()
    ]
    return torch.linalg.vector_norm(
        torch.stack([n.to(device, torch.float64) for n in norms]), norm_type
    ).to(dtype)


def _over_stages(total: torch.Tensor, norm_type: float, pp_mesh: DeviceMesh) -> torch.Tensor:
    """The norm over every stage from each stage's ``total``: one all-reduce over ``pp_mesh``."""
    partial = total.to(pp_mesh.device_type, torch.float64)
    if norm_type == math.inf:
        dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
    else:
        partial = partial.pow(norm_type)
        dist.all_reduce(partial, group=pp_mesh.get_group())
        partial = partial.pow(1.0 / norm_type)
    return partial.to(total.device, total.dtype)


def _split_by_group(
    params: list[torch.Tensor],
) -> tuple[list[torch.Tensor], dict[tuple[int, ...], tuple[list, list[torch.Tensor]]]]:
    """The non-empty gradients this rank holds whole, and the others by the process groups
    their pieces' norms are summed over -- the shard group, and under tensor or expert
    parallelism the groups of the mesh dims a DTensor is cut on -- in first appearance order,
    the same on every rank of a group."""
    plain: list[torch.Tensor] = []
    groups: dict[tuple[int, ...], tuple[list, list[torch.Tensor]]] = {}
    for p in params:
        reduce_over = _groups_of(p)
        # The local pieces: the norms here are reduced by hand, not as DTensors.
        grad = local_piece(p.grad)
        if not reduce_over:
            if grad.numel() > 0:
                plain.append(grad)
        else:
            key = tuple(id(g) for g in reduce_over)
            groups.setdefault(key, (reduce_over, []))[1].append(grad)
    return plain, groups


def _groups_of(param: torch.Tensor) -> list:
    """The groups a parameter's gradient is cut over: its shard group (none for a one-rank
    layout), and the groups of the other mesh dims a DTensor is ``Shard``-ed on."""
    out = []
    group = comm_group(param)
    if group is not None:
        out.append(group)
    grad = param.grad
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        for dim, placement in enumerate(grad.placements):
            if isinstance(placement, Shard) and mesh.size(dim) > 1:
                out.append(mesh.get_group(dim))
    return out


def _group_norm(
    groups: list,
    grads: list[torch.Tensor],
    norm_type: float,
    device: torch.device,
    foreach: bool | None,
) -> torch.Tensor:
    """The norm of gradients cut over ``groups``: one all-reduce per group of the local partial
    sums (``MAX`` for the infinity norm), joined by every rank even with no local piece."""
    # Float64 so that |g|^p of large gradients neither overflows nor loses the small ones.
    local = [g for g in grads if g.numel() > 0]
    partial = (
        get_total_norm(local, norm_type, foreach=foreach).to(device, torch.float64)
        if local
        else torch.zeros((), dtype=torch.float64, device=device)
    )
    if norm_type == math.inf:
        for group in groups:
            dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=group)
        return partial
    partial = partial.pow(norm_type)
    for group in groups:
        dist.all_reduce(partial, group=group)
    return partial.pow(1.0 / norm_type)
