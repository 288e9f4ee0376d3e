"""FSDP beside expert parallelism: one launch of 4 Gloo ranks on a (dp=2, ep=2) mesh trains a tiny
mixture of experts whose expert weights are DTensors ``Shard(0)`` over mesh["ep"], sharded over
mesh["dp"], while every other parameter is sharded over dp and ep flattened (torchtitan's layout:
ep borrows its ranks from data parallelism, so the four ranks hold four slices of the batch) --
with rf.fully_shard and with FSDP2 in the same launch, against one process on the global batch.
Tokens reach their experts by all_to_all_single over the ep group and come back the same way.
The parameters carry both placements, checkpoints move between the two and across dp sizes, and
bad input is one clear error before any collective.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import raggedfsdp as rf
from harness import assert_close_dicts, error_message, full_state, run_distributed
from optim_grid import set_whole_grads
from raggedfsdp.models.expert_parallel import exchange_rows

WORLD, DP, EP = 4, 2, 2
DIM, HIDDEN, EXPERTS, TOP_K = 8, 16, 4, 2
TOKENS = 6  # per rank: the global batch is WORLD * TOKENS
IMPLS: dict[str, Callable[..., Any]] = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}

try:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
except ImportError:  # an older torch: raggedfsdp's full-mesh form alone against the reference
    TorchDims = None

try:  # FSDP2's per-parameter meshes (newer than torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # the same two fields, as torchtitan's workaround for older torches has it

    class ShardPlacementResult(NamedTuple):  # type: ignore[no-redef]
        placement: Shard
        mesh_info: FSDPMeshInfo


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds: the local tensor of an expert-parallel DTensor."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class Experts(nn.Module):
    """``EXPERTS`` two-layer MLPs, their weights stacked ``[experts, in, out]`` (a DTensor
    ``Shard(0)`` over ep holds ``EXPERTS / ep`` of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` grouped by the local expert they go to, ``counts[e]`` of them for ``e``."""
        w1, w2 = _local(self.w1), _local(self.w2)
        chunks = tokens.split(counts)
        return torch.cat([torch.relu(c @ w1[e]) @ w2[e] for e, c in enumerate(chunks)])


class MoE(nn.Module):
    """A router choosing ``TOP_K`` experts per token; with an ep group the tokens travel to the
    rank holding their expert and back (torchtitan's token dispatch, by all_to_all_single)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):  # a program on the whole mesh: the MoE maps the local rows
            return DTensor.from_local(self.forward(x.to_local()), x.device_mesh, x.placements)
        router = F.linear(x, _local(self.router.weight))
        weights, chosen = torch.softmax(router, dim=-1).topk(TOP_K, dim=-1)
        order = chosen.reshape(-1).argsort(stable=True)  # each token's TOP_K copies by expert
        tokens = x.repeat_interleave(TOP_K, dim=0)[order]
        counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
        out = self._dispatch(tokens, counts)[order.argsort()]
        return (out.view(-1, TOP_K, DIM) * weights.unsqueeze(-1)).sum(1)

    def _dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.experts(tokens, counts.tolist())
        ep = dist.get_world_size(self.ep_group)
        local = EXPERTS // ep
        received = torch.empty_like(counts)  # [source rank, my expert]: how many tokens
        dist.all_to_all_single(received, counts, group=self.ep_group)
        grid = received.view(ep, local)
        send, recv = counts.view(ep, local).sum(1).tolist(), grid.sum(1).tolist()
        arrived = exchange_rows(tokens, recv, send, self.ep_group)  # by source, then expert
        pieces = arrived.split(grid.reshape(-1).tolist())
        by_expert = torch.cat([pieces[s * local + e] for e in range(local) for s in range(ep)])
        done = self.experts(by_expert, grid.sum(0).tolist()).split(grid.t().reshape(-1).tolist())
        back = torch.cat([done[e * ep + s] for s in range(ep) for e in range(local)])
        return exchange_rows(back, send, recv, self.ep_group)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = MoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class Net(nn.Module):
    """``tower``: with a layer (a vision tower's stand-in) that a forward runs only where its
    batch has an image."""

    def __init__(self, tower: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(6, DIM)
        self.tower = nn.Linear(6, DIM) if tower else None
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.output = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor, image: bool = False) -> torch.Tensor:
        h = self.embed(x)
        if image:
            h = h + self.tower(x)
        for block in self.blocks:
            h = block(h)
        out = self.output(h)
        return (out.to_local() if isinstance(out, DTensor) else out).pow(2).mean()


def _place_experts(block: Block, ep_mesh: DeviceMesh, placement: Shard | None = None) -> None:
    """The experts' weights as DTensors over ep, ``Shard(0)`` unless ``placement``: whole
    experts per rank (torchtitan's ExpertParallel); the tokens travel over the ep group."""
    experts = block.moe.experts
    for name, param in list(experts.named_parameters()):
        weight = distribute_tensor(param.detach(), ep_mesh, [placement or Shard(0)])
        setattr(experts, name, nn.Parameter(weight))
    block.moe.ep_group = ep_mesh.get_group()


def _parallelize(
    impl: str,
    model: Net,
    meshes: tuple[Any, Any],
    divide: bool = True,
    expert_dim: int = 0,
) -> Net:
    """Expert parallelism over mesh["ep"], then FSDP: the experts over mesh["dp"], the rest over
    dp and ep flattened (``dense``). ``divide``: the experts' gradients divided by every data
    rank, as torchtitan sets it for FSDP2 (FSDP2 divides by the experts' own mesh otherwise;
    raggedfsdp divides by all the data-parallel ranks either way). ``expert_dim``: the experts
    sharded over dp along that dim by ``shard_placement_fn`` (torchtitan's ``Shard(1)`` when the
    FSDP degree exceeds the experts), 0 the default."""
    mesh, dense = meshes
    placement_fn = (lambda p: Shard(expert_dim)) if expert_dim else None
    for block in model.blocks:
        _place_experts(block, mesh["ep"])
        experts = IMPLS[impl](block.moe.experts, mesh=mesh["dp"], shard_placement_fn=placement_fn)
        if divide:
            experts.set_force_sum_reduction_for_comms(True)  # Gloo has no PREMUL_SUM
            experts.set_gradient_divide_factor(float(mesh.size()))
        IMPLS[impl](block, mesh=dense)
    IMPLS[impl](model, mesh=dense)
    return model


def _per_parameter_meshes(model: Net, meshes: tuple[Any, Any], expert_dim: int = 0) -> Net:
    """torchtitan's ``apply_fsdp`` with expert parallelism, on raggedfsdp: one ``fully_shard``
    per block over the dense mesh, whose ``shard_placement_fn`` gives the experts'
    weights ``ShardPlacementResult(Shard(expert_dim), <mesh["dp"]'s FSDPMeshInfo>)`` and every
    other parameter ``ShardPlacementResult(Shard(0), <the dense mesh's>)``."""
    mesh, dense = meshes
    experts_info = FSDPMeshInfo(mesh=mesh["dp"], shard_mesh_dim=0)
    dense_info = FSDPMeshInfo(mesh=dense, shard_mesh_dim=0)
    for block in model.blocks:
        _place_experts(block, mesh["ep"])
        experts = set(block.moe.experts.parameters())

        def placement_fn(param: nn.Parameter, experts: set = experts) -> ShardPlacementResult:
            if param in experts:
                return ShardPlacementResult(placement=Shard(expert_dim), mesh_info=experts_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

        rf.fully_shard(block, mesh=dense, shard_placement_fn=placement_fn)
    rf.fully_shard(model, mesh=dense)
    return model


def _full_mesh(impl: str, model: Net, mesh: DeviceMesh) -> Net:
    """FSDP2's full-mesh form of the same layout: every parameter a DTensor on the whole (dp, ep)
    mesh (experts ``Shard(0)`` over ep, the rest replicated), the experts sharded over dp
    (``dp_mesh_dims(shard="dp")``), the rest over dp and ep flattened (``shard=("dp", "ep")``)."""
    dims = rf.DataParallelMeshDims if impl == "rf" else TorchDims
    for module in model.modules():
        placements = (Replicate(), Shard(0) if isinstance(module, Experts) else Replicate())
        for name, param in list(module.named_parameters(recurse=False)):
            weight = distribute_tensor(param.detach(), mesh, placements)
            module.register_parameter(name, nn.Parameter(weight))
    for block in model.blocks:
        block.moe.ep_group = mesh.get_group("ep")
        experts = IMPLS[impl](block.moe.experts, mesh=mesh, dp_mesh_dims=dims(shard="dp"))
        experts.set_force_sum_reduction_for_comms(True)  # Gloo has no PREMUL_SUM
        experts.set_gradient_divide_factor(float(mesh.size()))
        IMPLS[impl](block, mesh=mesh, dp_mesh_dims=dims(shard=("dp", "ep")))
    IMPLS[impl](model, mesh=mesh, dp_mesh_dims=dims(shard=("dp", "ep")))
    return model


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(TOKENS * WORLD, 6, generator=generator) for _ in range(steps)]


def _train(
    model: nn.Module,
    data_rank: int | None,
    clip: Callable[..., Any] | None = None,
    mesh: DeviceMesh | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Three AdamW steps; the full gradients of the first (before any clip) and the trained
    parameters. ``data_rank``: this rank's slice of each global batch (None: all of it);
    ``mesh``: given as a DTensor split by rows over both its dims (the full-mesh form)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads: dict[str, torch.Tensor] = {}
    for x in _batches(3):
        mine = x if data_rank is None else x[data_rank * TOKENS : (data_rank + 1) * TOKENS]
        if mesh is not None:
            mine = DTensor.from_local(mine, mesh, (Shard(0), Shard(0)))
        model(mine).backward()
        grads = grads or {n: _whole(p.grad) for n, p in model.named_parameters()}
        if clip is not None:
            clip(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    if data_rank is None:
        return {"grads": grads, "trained": {k: v.clone() for k, v in model.state_dict().items()}}
    return {"grads": grads, "trained": full_state(model)}


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def _grid(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, EP), mesh_dim_names=("dp", "ep"))
    meshes = (mesh, mesh["dp", "ep"]._flatten("dp_ep"))
    data_rank = meshes[1].get_local_rank()
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {
        "reference": _train(copy.deepcopy(base), None),
        "reference_clipped": _train(copy.deepcopy(base), None, torch.nn.utils.clip_grad_norm_),
    }
    models = {}
    for impl in IMPLS:
        models[impl] = _parallelize(impl, copy.deepcopy(base), meshes)
        out[impl] = _train(models[impl], data_rank)
        out[impl]["placements"] = _placements(models[impl])
    for impl in IMPLS if TorchDims is not None else ("rf",):
        spmd = _full_mesh(impl, copy.deepcopy(base), mesh)
        out[f"{impl}_full_mesh"] = _train(spmd, data_rank, mesh=mesh)
        weights = (spmd.blocks[0].moe.experts.w1, spmd.blocks[0].moe.router.weight)
        out[f"{impl}_full_mesh"]["dims"] = [w.device_mesh.mesh_dim_names for w in weights]
    out["shard_1"] = _shard_1(base, meshes, data_rank, path)
    out["per_parameter"] = _per_parameter(base, meshes, data_rank, path, models["fsdp2"])
    default = _parallelize("rf", copy.deepcopy(base), meshes, divide=False)
    out["rf_default_divide"] = _train(default, data_rank)
    clipped = _parallelize("rf", copy.deepcopy(base), meshes, divide=False)
    out["rf_clipped"] = _train(clipped, data_rank, rf.clip_grad_norm_)
    out["checkpoints"] = _checkpoints(base, meshes, models, data_rank, path)
    out["muon"] = _muon(base, meshes)
    out["uneven"] = _uneven(meshes, data_rank)
    out["errors"] = _errors(base, meshes)
    return out


def _uneven(meshes: tuple[Any, Any], data_rank: int) -> dict[str, Any]:
    """Ranks whose graphs differ beside expert parallelism: the tower (a unit of its own over the
    dense mesh) runs on the data ranks whose batch has an image (two of four in the first two
    steps, none in the third), AdamW; raggedfsdp and one process on the global batch (the mean of
    the ranks' losses, each with its plan). The agreement runs over both meshes."""
    torch.manual_seed(0)
    base = Net(tower=True)
    out = {}
    for where in (None, data_rank):
        model = copy.deepcopy(base)
        if where is not None:
            rf.fully_shard(model.tower, mesh=meshes[1])
            _parallelize("rf", model, meshes, divide=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step, x in enumerate(_batches(3)):
            ranks = range(WORLD) if where is None else [where]
            losses = [
                model(x[r * TOKENS : (r + 1) * TOKENS], image=(r + step) % 2 == 0 and step < 2)
                for r in ranks
            ]
            torch.stack(losses).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if where is None:
            out["reference"] = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            out["rf"] = full_state(model)
    return out


def _shard_1(base: Net, meshes: tuple[Any, Any], data_rank: int, path: str) -> dict[str, Any]:
    """torchtitan's experts ``Shard(1)`` over dp (beside ``Shard(0)`` over ep), with each
    implementation: trained, placed, and each one's DCP checkpoint loaded into the other."""
    out: dict[str, Any] = {}
    models = {}
    for impl in IMPLS:
        models[impl] = _parallelize(impl, copy.deepcopy(base), meshes, expert_dim=1)
        out[impl] = _train(models[impl], data_rank)
        out[impl]["placements"] = _placements(models[impl])
    torch.manual_seed(9)  # other values, which the loads must replace
    other = Net()
    for saver, loader in (("rf", "fsdp2"), ("fsdp2", "rf")):
        saved = os.path.join(path, f"shard_1_{saver}")
        dcp.save(models[saver].state_dict(), checkpoint_id=saved)
        into = _parallelize(loader, copy.deepcopy(other), meshes, expert_dim=1)
        out[f"{saver}_into_{loader}"] = _load(into, saved)
    return out


def _per_parameter(
    base: Net, meshes: tuple[Any, Any], data_rank: int, path: str, fsdp2: Net
) -> dict[str, Any]:
    """torchtitan's per-parameter meshes on raggedfsdp (experts ``Shard(0)`` and ``Shard(1)``
    over dp): trained and placed; its checkpoint loaded into FSDP2 (the experts a unit of their
    own over dp, the same layout), and FSDP2's trained ``fsdp2`` loaded into it."""
    out: dict[str, Any] = {}
    for dim in (0, 1):
        model = _per_parameter_meshes(copy.deepcopy(base), meshes, expert_dim=dim)
        out[dim] = _train(model, data_rank)
        out[dim]["placements"] = _placements(model)
    torch.manual_seed(9)  # other values, which the loads must replace
    other = Net()
    saved = os.path.join(path, "per_parameter")
    dcp.save(model.state_dict(), checkpoint_id=saved)
    into = _parallelize("fsdp2", copy.deepcopy(other), meshes, expert_dim=1)
    out["into_fsdp2"] = _load(into, saved)
    from_fsdp2 = os.path.join(path, "per_parameter_fsdp2")
    dcp.save(fsdp2.state_dict(), checkpoint_id=from_fsdp2)
    out["fsdp2_saved"] = full_state(fsdp2)
    into = _per_parameter_meshes(copy.deepcopy(other), meshes)
    out["from_fsdp2"] = _load(into, from_fsdp2)
    return out


def _muon(base: Net, meshes: tuple[Any, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Two steps of raggedfsdp's Muon (each expert a matrix of its own; 1-D parameters to the
    auxiliary AdamW) given the same whole gradients, on the dp x ep model and on one device."""
    generator = torch.Generator().manual_seed(5)
    named = dict(base.named_parameters())
    grads = [{n: torch.randn(p.shape, generator=generator) for n, p in named.items()}] * 2
    out = {}
    for kind in ("rf", "reference"):
        model = copy.deepcopy(base)
        if kind == "rf":
            model = _parallelize("rf", model, meshes, divide=False)
        optimizer = rf.optim.Muon(model.named_parameters(), adamw_params=lambda p, s: len(s) < 2)
        for step in grads:
            set_whole_grads(model, step)
            optimizer.step()
        out[kind] = full_state(model) if kind == "rf" else dict(model.state_dict())
    return out


def _placements(model: nn.Module) -> dict[str, Any]:
    """The mesh dims and placements of an expert weight and of a dense one, and what the
    experts' forward sees."""
    expert, dense = model.blocks[0].moe.experts.w1, model.blocks[0].moe.router.weight
    seen: list[Any] = []
    handle = model.blocks[0].moe.experts.register_forward_pre_hook(
        lambda m, args: seen.append((type(m.w1).__name__, [str(p) for p in m.w1.placements]))
    )
    with torch.no_grad():
        model(torch.zeros(TOKENS, 6))
    handle.remove()
    return {
        "expert": (expert.device_mesh.mesh_dim_names, [str(p) for p in expert.placements]),
        "dense": (dense.device_mesh.mesh_dim_names, [str(p) for p in dense.placements]),
        "expert_local_numel": expert.to_local().numel(),
        "forward_sees": seen[0],
    }


def _checkpoints(
    base: Net, meshes: tuple[Any, Any], models: dict[str, Net], data_rank: int, path: str
) -> dict[str, Any]:
    """A DCP checkpoint of raggedfsdp+EP trained at (dp=2, ep=2), loaded into FSDP2+EP at (2, 2)
    and into raggedfsdp at (dp=1, ep=2) on ranks 0 and 1; and FSDP2's trained model saved and
    loaded into raggedfsdp at (2, 2)."""
    saved = os.path.join(path, "rf")
    dcp.save(models["rf"].state_dict(), checkpoint_id=saved)
    out = {"saved": full_state(models["rf"]), "fsdp2_saved": full_state(models["fsdp2"])}
    torch.manual_seed(9)  # other values, which the loads must replace
    other = Net()
    out["into_fsdp2"] = _load(_parallelize("fsdp2", copy.deepcopy(other), meshes), saved)
    from_fsdp2 = os.path.join(path, "fsdp2")
    dcp.save(models["fsdp2"].state_dict(), checkpoint_id=from_fsdp2)
    out["from_fsdp2"] = _load(_parallelize("rf", copy.deepcopy(other), meshes), from_fsdp2)
    smaller = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("dp", "ep"))
    narrow = (smaller, smaller["dp", "ep"]._flatten("dp_ep"))  # new groups: on every rank
    if smaller.get_coordinate() is not None:
        model = _parallelize("rf", copy.deepcopy(other), narrow)
        out["dp1"] = _load(model, saved, narrow[1].get_group())
    return out


def _load(model: nn.Module, path: str, group: Any = None) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path, process_group=group)
    model.load_state_dict(state)
    return full_state(model)


def _errors(base: Net, meshes: tuple[Any, Any]) -> dict[str, str]:
    """Bad input, each one error naming the parameter before any collective."""
    mesh, dense = meshes
    x = torch.zeros(TOKENS, 6)
    plain = copy.deepcopy(base)  # experts over mesh["dp"], but never placed over ep
    for block in plain.blocks:
        rf.fully_shard(block.moe.experts, mesh=mesh["dp"])
        rf.fully_shard(block, mesh=dense)
    rf.fully_shard(plain, mesh=dense)
    flattened = copy.deepcopy(base.blocks[0])  # experts over ep and over a mesh holding ep
    _place_experts(flattened, mesh["ep"])
    columns = copy.deepcopy(base)  # the experts' columns, not whole experts, over ep
    for block in columns.blocks:
        _place_experts(block, mesh["ep"], Shard(2))
        rf.fully_shard(block.moe.experts, mesh=mesh["dp"])
    rf.fully_shard(columns, mesh=dense)
    sharded = _parallelize("rf", copy.deepcopy(base), meshes)
    experts = [p for n, p in sharded.named_parameters() if "experts" in n]
    return {
        "not_placed": error_message(lambda: plain(x)),
        "flattened": error_message(lambda: rf.fully_shard(flattened.moe.experts, mesh=dense)),
        "columns": error_message(lambda: columns(x)),
        "short_mesh": _short_mesh(base, x),
        "too_big": error_message(lambda: init_device_mesh("cpu", (DP, EP + 1))),
        "shampoo": error_message(lambda: rf.optim.Shampoo(experts, lr=0.01)),
        "muon_columns": error_message(
            lambda: rf.optim.Muon([(n, p) for n, p in columns.named_parameters() if "experts" in n])
        ),
    }


def _short_mesh(base: Net, x: torch.Tensor) -> str:
    """A (x=2, dp=1, ep=2) mesh: experts over dp x ep = 2 ranks, the rest over all 4."""
    mesh = init_device_mesh("cpu", (2, 1, EP), mesh_dim_names=("x", "dp", "ep"))
    model = copy.deepcopy(base)
    for block in model.blocks:
        _place_experts(block, mesh["ep"])
        rf.fully_shard(block.moe.experts, mesh=mesh["dp"])
    rf.fully_shard(model)
    return error_message(lambda: model(x))


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_grid, WORLD, str(tmp_path_factory.mktemp("ep_dcp")))


def test_ranks_whose_graphs_differ_beside_expert_parallelism(grid):
    """A unit skipped on some data ranks, beside experts on a mesh of their own: one process's
    parameters on every rank (FSDP2 is not run: it hangs there)."""
    for rank in grid:
        assert_close_dicts(rank["uneven"]["rf"], rank["uneven"]["reference"])


@pytest.mark.parametrize("impl", ["rf", "fsdp2", "rf_default_divide"])
def test_dp_x_ep_computes_the_gradients_and_steps_of_one_process(grid, impl):
    for rank in grid:
        assert_close_dicts(rank[impl]["grads"], rank["reference"]["grads"])
        assert_close_dicts(rank[impl]["trained"], rank["reference"]["trained"])


def test_full_mesh_form_beside_expert_parallelism(grid):
    """dp_mesh_dims over DTensors on the whole (dp, ep) mesh, the MoE a local map: the same
    gradients and steps as one process, for raggedfsdp and FSDP2's form."""
    for rank in grid:
        for impl in ("rf", "fsdp2"):
            if f"{impl}_full_mesh" in rank:
                result = rank[f"{impl}_full_mesh"]
                assert_close_dicts(result["grads"], rank["reference"]["grads"])
                assert_close_dicts(result["trained"], rank["reference"]["trained"])
        assert rank["rf_full_mesh"]["dims"] == [("dp", "ep"), ("dp_ep",)]


def test_experts_carry_dp_and_ep_the_rest_the_flattened_mesh(grid):
    for rank in grid:
        placements = rank["rf"]["placements"]
        assert placements["expert"] == (("dp", "ep"), ["RS", str(Shard(0))])
        assert placements["dense"] == (("dp_ep",), ["RS"])
        assert placements["forward_sees"] == ("DTensor", [str(Shard(0))])
        assert rank["fsdp2"]["placements"]["expert"][0] == ("dp", "ep")
    # dp pairs (0, 2) and (1, 3) split the experts their ep rank holds
    pieces = [rank["rf"]["placements"]["expert_local_numel"] for rank in grid]
    assert pieces[0] + pieces[2] == pieces[1] + pieces[3] == EXPERTS // EP * DIM * HIDDEN


def test_experts_sharded_on_dim_1_as_torchtitan_asks(grid):
    """``Shard(1)`` over dp from shard_placement_fn (torchtitan's, when the FSDP degree exceeds
    the experts): one process's gradients and steps, FSDP2's placements and local pieces (the
    control: the default run's experts are ragged, ``RS``), and DCP checkpoints moving both
    ways between raggedfsdp and FSDP2 in that layout."""
    for rank in grid:
        ours, theirs = rank["shard_1"]["rf"], rank["shard_1"]["fsdp2"]
        for result in (ours, theirs):
            assert_close_dicts(result["grads"], rank["reference"]["grads"])
            assert_close_dicts(result["trained"], rank["reference"]["trained"])
        assert ours["placements"]["expert"] == (("dp", "ep"), [str(Shard(1)), str(Shard(0))])
        assert ours["placements"]["expert"] == theirs["placements"]["expert"]
        assert ours["placements"]["expert_local_numel"] == EXPERTS // EP * DIM * HIDDEN // DP
        assert ours["placements"]["forward_sees"] == theirs["placements"]["forward_sees"]
        assert rank["rf"]["placements"]["expert"][1][0] == "RS"
        assert_close_dicts(rank["shard_1"]["rf_into_fsdp2"], ours["trained"])
        assert_close_dicts(rank["shard_1"]["fsdp2_into_rf"], theirs["trained"])


def test_per_parameter_meshes_as_torchtitan_gives_them(grid):
    """One fully_shard per block, the experts on a mesh of their own through
    ShardPlacementResult (torchtitan's apply_fsdp): one process's gradients and steps, the
    placements FSDP2 gives (experts over dp and ep, ``Shard(0)`` ragged or ``Shard(1)``; the
    rest over the flattened mesh), DCP checkpoints both ways with FSDP2."""
    for rank in grid:
        ours = rank["per_parameter"]
        for dim in (0, 1):
            assert_close_dicts(ours[dim]["grads"], rank["reference"]["grads"])
            assert_close_dicts(ours[dim]["trained"], rank["reference"]["trained"])
        assert ours[0]["placements"] == rank["rf"]["placements"]
        assert ours[1]["placements"] == rank["shard_1"]["rf"]["placements"]
        assert ours[1]["placements"]["expert"] == rank["shard_1"]["fsdp2"]["placements"]["expert"]
        assert_close_dicts(ours["into_fsdp2"], ours[1]["trained"])
        assert_close_dicts(ours["from_fsdp2"], ours["fsdp2_saved"])


def test_clip_reduces_the_norm_over_both_meshes(grid):
    for rank in grid:
        assert_close_dicts(rank["rf_clipped"]["trained"], rank["reference_clipped"]["trained"])


def test_checkpoint_moves_between_fsdp2_and_across_dp_sizes(grid):
    for rank, result in enumerate(grid):
        checkpoints = result["checkpoints"]
        assert_close_dicts(checkpoints["into_fsdp2"], checkpoints["saved"])
        assert_close_dicts(checkpoints["from_fsdp2"], checkpoints["fsdp2_saved"])
        if rank < 2:
            assert_close_dicts(checkpoints["dp1"], checkpoints["saved"])


def test_bad_input_is_one_clear_error(grid):
    for rank in grid:
        errors = rank["errors"]
        assert (
            "parameter 'blocks.0.moe.experts.w1' is sharded over mesh ('dp',)"
            in (errors["not_placed"])
        )
        assert "combine the data of 2 ranks" in errors["not_placed"]
        assert "'w1'" in errors["flattened"] and "also data-parallel ranks" in errors["flattened"]
        assert "'blocks.0.moe.experts.w1' of shape [4, 8, 16]" in errors["columns"]
        assert "whole experts" in errors["columns"]
        assert "data-parallel ranks under this root are 4" in errors["short_mesh"]
        assert "Mesh should not be bigger than default world size" in errors["too_big"]
        assert "split by tensor or expert parallelism" in errors["shampoo"]
        assert "'blocks.0.moe.experts.w1' (global shape [4, 8, 16])" in errors["muon_columns"]
        assert "a stack of matrices split inside each matrix" in errors["muon_columns"]


def test_muon_on_experts_is_one_devices_muon(grid):
    """Expert parallelism keeps each expert's matrix whole: the same whole gradients give
    bitwise the numbers of one device."""
    for rank in grid:
        muon = rank["muon"]
        assert muon["rf"].keys() == muon["reference"].keys()
        for key, value in muon["reference"].items():
            assert torch.equal(muon["rf"][key], value), key
