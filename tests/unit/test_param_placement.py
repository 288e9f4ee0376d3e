"""Each parameter's form is chosen once, at ``fully_shard``, and carries what differs between the
forms (``runtime/_param_placement.py``): on a mesh of one process, the sharded parameter, what
forward computes with and the unsharded gradient of a plain, a sub-mesh and a full-mesh
parameter."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import raggedfsdp as rf
from raggedfsdp.runtime._hooks import state_of
from raggedfsdp.runtime._param_placement import FullMesh, Plain, SubMesh


def _sharded(model: nn.Module, on, parallel: list, **kwargs):
    """``model``'s Linear with its weight placed ``parallel`` on ``on`` (plain when empty),
    fully_shard-ed with ``kwargs``; its one parameter record, and what forward computed with."""
    if parallel:
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), on, parallel))
    rf.fully_shard(model, **kwargs)
    (param,) = state_of(model).group.params
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    x = torch.randn(3, 4)
    if parallel:
        x = DTensor.from_local(x, on, [Replicate()] * on.ndim, run_check=False)
    out = model(x)
    handle.remove()
    (out.to_local() if isinstance(out, DTensor) else out).sum().backward()
    return param, seen[0]


def test_each_form_places_its_parameter(group_of_one) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))

    param, computed = _sharded(nn.Linear(4, 2, bias=False), mesh, [], mesh=mesh["dp"])
    assert type(param.placement) is Plain and param.placement.split is None
    assert type(computed) is nn.Parameter and not isinstance(computed, DTensor)
    assert param.sharded.device_mesh.mesh_dim_names == ("dp",)
    assert len(param.unsharded._backward_hooks) == 1  # the unit's own: the gradient arrived

    param, computed = _sharded(nn.Linear(4, 2, bias=False), mesh["tp"], [Shard(0)], mesh=mesh["dp"])
    assert type(param.placement) is SubMesh
    assert computed.placements == (Shard(0),) and computed.device_mesh == mesh["tp"]
    assert param.sharded.device_mesh.mesh_dim_names == ("dp", "tp")
    assert param.sharded.placements[1] == Shard(0)
    assert param.sharded.grad is not None and param.sharded.grad.placements[1] == Shard(0)
    assert len(param.unsharded._backward_hooks) == 1

    param, computed = _sharded(
        nn.Linear(4, 2, bias=False),
        mesh,
        [Replicate(), Shard(0)],
        mesh=mesh,
        dp_mesh_dims=rf.DataParallelMeshDims(shard="dp"),
    )
    assert type(param.placement) is FullMesh and type(param.placement.inner) is SubMesh
    assert computed.device_mesh is mesh and computed.placements == (Replicate(), Shard(0))
    assert param.sharded.device_mesh is mesh  # the caller's own mesh object
    # the unsharded gradient is relabelled Partial over dp before autograd accumulates it, by a
    # hook of its own (the other forms register none: the counts above)
    assert len(param.unsharded._backward_hooks) == 2
    assert param.placement.grad(torch.zeros(2, 4), param.unsharded).placements == (
        Partial(),
        Shard(0),
    )
