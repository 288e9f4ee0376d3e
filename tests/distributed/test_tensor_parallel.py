"""FSDP on the data-parallel dim of a (dp, tp) mesh, beside tensor parallelism: one launch of 4
Gloo ranks trains a model whose blocks are tensor-parallel (ColwiseParallel / RowwiseParallel over
mesh["tp"]; a second model with SequenceParallel norms) and then sharded over mesh["dp"], with
rf.fully_shard and with FSDP2 in the same launch, against one process on the global batch; the
parameters carry both placements, the gradients are reduced over dp only, and a checkpoint moves
between the two and across dp sizes. A block whose weights are DTensors over tp with an fp8-cast
tensor subclass (FSDP2's all-gather extension protocol) as local tensors trains under both too,
with the same gradient norm, and goes through DCP.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import raggedfsdp as rf
from harness import (
    assert_close_dicts,
    drawn,
    drawn_whole,
    error_message,
    full_state,
    run_distributed,
)
from optim_grid import muon_on_one_device, set_whole_grads
from raggedfsdp.runtime._hooks import states_under
from raggedfsdp.runtime._subclass import SubclassGroup
from subclasses import Fp8CastWeight

WORLD, DP, TP = 4, 2, 2
BATCH = 3  # per data-parallel rank
IMPLS: dict[str, Callable[..., Any]] = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 8, vocab: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(6, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.output = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.output(h).pow(2).mean()


class NormBlock(nn.Module):
    """A block with a norm, as sequence parallelism splits one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class SequenceNet(nn.Module):
    """Sequences in, a mean of squares out: the layout torchtitan's sequence parallelism
    splits (embedding to the sequence shards, norms on them, head back to whole sequences)."""

    def __init__(self, dim: int = 8, vocab: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(6, dim)
        self.blocks = nn.ModuleList(NormBlock(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h)).pow(2).mean()


def _sequence_parallel(model: SequenceNet, mesh: Any) -> None:
    """torchtitan's plan with sequence parallelism: activations between blocks split by
    sequence over tp, the norms computed on those splits (their gradients Partial over tp)."""
    tp = mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp, plan)


def _train_sequences(impl: str | None, base: SequenceNet, mesh: Any, dp_rank: int) -> Any:
    """3 SGD steps on sequences (one process on the global batch when ``impl`` is None, else
    sequence parallelism then FSDP over dp); SGD, so a gradient missing its all-reduce over tp
    moves the weights otherwise."""
    model = copy.deepcopy(base)
    if impl is not None:
        _sequence_parallel(model, mesh)
        for block in model.blocks:
            IMPLS[impl](block, mesh=mesh["dp"])
        IMPLS[impl](model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(BATCH * DP, 4, 6, generator=generator)
        mine = x if impl is None else x[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        model(mine).backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model) if impl is not None else dict(model.state_dict())


def _parallelize(impl: str, model: Net, mesh: Any) -> Net:
    """torchtitan's order: tensor parallelism over mesh["tp"], then FSDP over mesh["dp"]."""
    _tensor_parallel(model, mesh)
    for block in model.blocks:
        IMPLS[impl](block, mesh=mesh["dp"])
    IMPLS[impl](model, mesh=mesh["dp"])
    return model


def _tensor_parallel(model: Net, mesh: Any) -> None:
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH * DP, 6, generator=generator) for _ in range(steps)]


def _train(
    model: nn.Module, dp_rank: int | None, clip: Callable[..., Any] | None = None, steps: int = 3
) -> dict[str, torch.Tensor]:
    """AdamW steps; ``clip``: a clip_grad_norm_ at 0.5 (torch's clip cannot mix the meshes of
    a TP model's DTensors, FSDP2's or ours; raggedfsdp's reduces over both dims)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in _batches(steps):
        mine = x if dp_rank is None else x[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        model(mine).backward()
        if clip is not None:
            clip(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    if dp_rank is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return full_state(model)


def _grid(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    base = Net()
    out: dict[str, Any] = {
        "reference": _train(copy.deepcopy(base), None),
        "reference_clipped": _train(copy.deepcopy(base), None, torch.nn.utils.clip_grad_norm_),
    }
    for impl in IMPLS:
        model = _parallelize(impl, copy.deepcopy(base), mesh)
        weight = model.blocks[0].up.weight
        out[impl] = {
            "placements": [str(p) for p in weight.placements],
            "mesh_dims": weight.device_mesh.mesh_dim_names,
            "trained": _train(model, dp_rank),
        }
    clipped = _parallelize("rf", copy.deepcopy(base), mesh)
    out["rf"]["clipped"] = _train(clipped, dp_rank, rf.clip_grad_norm_)
    out["checkpoints"] = _checkpoints(base, mesh, dp_rank, path)
    out["meta"] = _built_on_meta(mesh)
    torch.manual_seed(1)
    sequences = SequenceNet()
    out["sequence_parallel"] = {
        impl: _train_sequences(impl, sequences, mesh, dp_rank) for impl in (None, *IMPLS)
    }
    out["muon"] = _muon(base, mesh)
    out["errors"] = _errors(base, mesh)
    out["subclass"] = _subclass_weights(base, mesh, dp_rank, path)
    return out


def _fp8_weights(block: Block) -> None:
    """The tensor-parallel weights' local tensors as :class:`Fp8CastWeight`: up's Shard(0),
    down's Shard(1)."""
    for linear in (block.up, block.down):
        weight = linear.weight
        local = Fp8CastWeight(weight.to_local().detach().clone())
        linear.weight = nn.Parameter(
            DTensor.from_local(
                local,
                weight.device_mesh,
                weight.placements,
                shape=weight.shape,
                stride=weight.stride(),
                run_check=False,
            )
        )


def _tp_local_whole(model: nn.Module, dp_group: Any) -> dict[str, torch.Tensor]:
    """Every parameter's tensor-parallel local tensor, whole over dp (its values: a subclass's
    fp32 data), from each dp rank's piece."""
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local()
        local = local._data if isinstance(local, Fp8CastWeight) else local
        pieces: list[Any] = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(pieces, local.detach().clone(), group=dp_group)
        if isinstance(param, rf.RaggedTensor):
            out[name] = param.shard_layout.from_locals(pieces)
        else:  # FSDP2's Shard(0) over dp: its chunks
            out[name] = torch.cat(pieces)
    return out


def _fp8_block(block: Block, mesh: Any, shard: Callable[..., Any], cast: bool = True) -> Block:
    """``block`` tensor-parallel over tp, its weights fp8-cast subclasses (``cast``), sharded
    over dp by ``shard``."""
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if cast:
        _fp8_weights(block)
    shard(block, mesh=mesh["dp"])
    return block


def _subclass_weights(base: Net, mesh: Any, dp_rank: int, path: str) -> dict[str, Any]:
    """A tensor-parallel block whose weights' local tensors are fp8-cast subclasses, sharded over
    dp by raggedfsdp and by FSDP2 and trained: each rank's tp-local parameters whole over dp,
    the sharded weights' placements and local class, the first step's gradient norm
    (``rf.clip_grad_norm_``'s; FSDP2's from its whole gradients), and raggedfsdp's all-gathered
    bytes by dtype; the negative control: the block with plain fp32 weights under raggedfsdp.
    Then raggedfsdp's trained state through DCP into a block of other values."""
    out: dict[str, Any] = {}
    group = mesh.get_group("dp")
    for name, shard, cast in (
        ("rf", rf.fully_shard, True),
        ("fsdp2", fsdp2_fully_shard, True),
        ("rf_fp32", rf.fully_shard, False),
    ):
        block = _fp8_block(copy.deepcopy(base.blocks[0]), mesh, shard, cast)
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(7)
        for step in range(3):
            x = torch.randn(BATCH * DP, 8, generator=generator)
            block(x[dp_rank * BATCH : (dp_rank + 1) * BATCH]).pow(2).mean().backward()
            if step == 0 and shard is rf.fully_shard:  # a max norm that clips nothing
                out[f"{name}/norm"] = float(rf.clip_grad_norm_(list(block.parameters()), 1e9))
            elif step == 0:
                grads = [p.grad.full_tensor() for p in block.parameters()]
                out[f"{name}/norm"] = float(torch.stack([g.norm() for g in grads]).norm())
            optimizer.step()
            optimizer.zero_grad()
        out[name] = _tp_local_whole(block, group)
        weights = (block.up.weight, block.down.weight)
        out[f"{name}/placements"] = [[str(p) for p in w.placements] for w in weights]
        out[f"{name}/classes"] = [type(w.to_local()).__name__ for w in weights]
        if name == "rf":
            trained = block
            gathered: dict[str, int] = {}
            for state in states_under(block):
                if isinstance(state.group, SubclassGroup):
                    for dtype, nbytes in state.group.subclass.gathered_bytes.items():
                        gathered[str(dtype)] = gathered.get(str(dtype), 0) + nbytes
            out["rf/bytes"] = gathered
    torch.serialization.add_safe_globals([Fp8CastWeight])  # the shards pickled as their class
    dcp.save(get_model_state_dict(trained), checkpoint_id=f"{path}/subclass")
    torch.manual_seed(9)  # other values, which the load must replace
    fresh = _fp8_block(Block(8), mesh, rf.fully_shard)
    out["dcp/before"] = _tp_local_whole(fresh, group)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=f"{path}/subclass")
    set_model_state_dict(fresh, state)
    out["dcp/loaded"] = _tp_local_whole(fresh, group)
    out["dcp/classes"] = [type(w.to_local()).__name__ for w in (fresh.up.weight, fresh.down.weight)]
    return out


def _muon(base: Net, mesh: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Two steps of raggedfsdp's Muon (1-D parameters to its auxiliary AdamW) given the same
    whole gradients: on the dp x tp model, on the TP model without FSDP, and -- the negative
    control -- with each tensor-parallel slice orthogonalised alone; beside torch's Muon and
    AdamW on one device."""
    generator = torch.Generator().manual_seed(5)
    named = dict(base.named_parameters())
    grads = [{n: torch.randn(p.shape, generator=generator) for n, p in named.items()}] * 2
    out = {}
    for kind in ("rf", "tp_only", "slices"):
        model = copy.deepcopy(base)
        if kind == "tp_only":
            _tensor_parallel(model, mesh)
        else:
            model = _parallelize("rf", model, mesh)
        optimizer = rf.optim.Muon(model.named_parameters(), adamw_params=lambda p, s: len(s) != 2)
        if kind == "slices":
            optimizer._splits = dict.fromkeys(optimizer._splits)  # forgets the TP splits
        for step in grads:
            set_whole_grads(model, step)
            optimizer.step()
        out[kind] = full_state(model)
    out["reference"] = muon_on_one_device(copy.deepcopy(base), grads)
    return out


def _errors(base: Net, mesh: Any) -> dict[str, str]:
    """Bad input, each one error naming it before any collective: a tile cut by the tensor-
    parallel split, and a DTensor sharded over the dims that hold it."""
    block = copy.deepcopy(base.blocks[0])
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    tiles = rf.RaggedShard(block_size=3)  # up.weight's 32 rows split 16 + 16: cuts 3-row tiles
    same = copy.deepcopy(base.blocks[0])
    parallelize_module(same, mesh["tp"], {"up": ColwiseParallel()})
    sharded = _parallelize("rf", copy.deepcopy(base), mesh)
    matrices = [p for p in sharded.parameters() if p.dim() == 2]
    uneven = nn.Linear(8, 5)  # 5 rows over 2 tensor-parallel ranks
    parallelize_module(uneven, mesh["tp"], ColwiseParallel())
    return {
        "peers": error_message(lambda: _muon_on_other_layouts(base, mesh)),
        "shampoo": error_message(lambda: rf.optim.Shampoo(matrices, lr=0.01)),
        "muon_uneven": error_message(lambda: rf.optim.Muon([uneven.weight], lr=0.01)),
        "tile_cut": error_message(
            lambda: rf.fully_shard(block, mesh=mesh["dp"], shard_policy=tiles)
        ),
        "same_dims": error_message(lambda: rf.fully_shard(same, mesh=mesh["tp"])),
    }


def _muon_on_other_layouts(base: Net, mesh: Any) -> None:
    """A program that shards differently on tensor-parallel peers (each block a unit on tp
    rank 0, the whole model one unit on tp rank 1: down.weight's slice lands on the other dp
    rank): Muon's first step must refuse it on every rank, not gather the wrong slices."""
    model = copy.deepcopy(base)
    _tensor_parallel(model, mesh)
    if mesh.get_local_rank("tp") == 0:
        for block in model.blocks:
            rf.fully_shard(block, mesh=mesh["dp"])
    rf.fully_shard(model, mesh=mesh["dp"])
    muon = rf.optim.Muon(model.named_parameters(), lr=0.01, adamw_params=lambda p, s: len(s) != 2)
    model(torch.randn(BATCH, 6)).backward()
    muon.step()


def _built_on_meta(mesh: Any) -> dict[str, Any]:
    """Built, split and sharded on meta, then ``rf.init_sharded_``: what the sharded weight is
    placed as afterwards, and the values (with one process's draw beside them)."""
    with torch.device("meta"):
        model = Net()
    model = _parallelize("rf", model, mesh)
    torch.manual_seed(7)
    rf.init_sharded_(model, drawn)  # materializes the shards, then fills them
    weight = model.blocks[0].up.weight
    return {
        "placements": [str(p) for p in weight.placements],
        "dims": weight.device_mesh.mesh_dim_names,
        "shape": list(weight.shape),
        "values": (full_state(model), drawn_whole(Net(), 7)),
    }


def _checkpoints(base: Net, mesh: Any, dp_rank: int, path: str) -> dict[str, Any]:
    """A DCP checkpoint of the model trained at (dp=2, tp=2), loaded into FSDP2+TP at (2, 2)
    and into raggedfsdp at (dp=1, tp=2) on ranks 0 and 1."""
    trained = _parallelize("rf", copy.deepcopy(base), mesh)
    _train(trained, dp_rank)
    dcp.save(trained.state_dict(), checkpoint_id=path)
    out = {"saved": full_state(trained)}
    torch.manual_seed(9)  # other values, which the load must replace
    other = Net()
    fsdp2 = _parallelize("fsdp2", copy.deepcopy(other), mesh)
    state = fsdp2.state_dict()
    dcp.load(state, checkpoint_id=path)
    fsdp2.load_state_dict(state)
    out["fsdp2"] = full_state(fsdp2)
    smaller = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("dp", "tp"))
    if smaller.get_coordinate() is not None:
        narrow = _parallelize("rf", copy.deepcopy(other), smaller)
        state = narrow.state_dict()
        dcp.load(state, checkpoint_id=path, process_group=smaller.get_group("tp"))
        narrow.load_state_dict(state)
        out["dp1"] = full_state(narrow)
    return out


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_grid, WORLD, str(tmp_path_factory.mktemp("tp_dcp")))


def test_dp_x_tp_trains_as_one_process_and_as_fsdp2(grid):
    for rank in grid:
        assert_close_dicts(rank["fsdp2"]["trained"], rank["reference"])
        assert_close_dicts(rank["rf"]["trained"], rank["reference"])


def test_sequence_parallel_trains_as_one_process_and_as_fsdp2(grid):
    """SequenceParallel norms: gradients Partial over tp, all-reduced there before the
    reduce-scatter over dp."""
    for rank in grid:
        trained = rank["sequence_parallel"]
        reference = trained[None]
        assert_close_dicts(trained["rf"], reference)
        assert_close_dicts(trained["fsdp2"], reference)
        # the norms trained: their gradients, reduced over tp, count
        assert (reference["blocks.0.norm.weight"] - 1).abs().max() > 1e-2


def test_parameters_carry_both_placements(grid):
    for rank in grid:
        assert rank["rf"]["mesh_dims"] == ("dp", "tp")
        ragged, tp = rank["rf"]["placements"]
        assert ragged == "RS" and tp == str(Shard(0))


def test_built_on_meta_init_sharded_places_and_draws_as_one_process(grid):
    """rf.init_sharded_ of a model built, split and sharded on meta: the weights keep both
    placements and their whole shape, and hold the values one process draws with that seed."""
    for rank in grid:
        meta = dict(rank["meta"])
        got, want = meta.pop("values")
        assert meta == {"placements": ["RS", str(Shard(0))], "dims": ("dp", "tp"), "shape": [32, 8]}
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_clip_reduces_the_norm_over_dp_and_tp(grid):
    for rank in grid:
        assert_close_dicts(rank["rf"]["clipped"], rank["reference_clipped"])


def test_checkpoint_loads_into_fsdp2_tp_and_at_another_dp_size(grid):
    for rank, result in enumerate(grid):
        saved = result["checkpoints"]["saved"]
        assert_close_dicts(result["checkpoints"]["fsdp2"], saved)
        if rank < 2:
            assert_close_dicts(result["checkpoints"]["dp1"], saved)


def test_tensor_parallel_peers_that_planned_apart_stop_muon_on_every_rank(grid):
    for rank in grid:
        message = rank["errors"]["peers"]
        assert "Muon: tensor-parallel peers hold different matrices or shard layouts" in message


def test_bad_input_is_one_clear_error(grid):
    errors = grid[0]["errors"]
    assert (
        "'up.weight' of shape [32, 8] is split by Shard(dim=0) over 2 ranks" in errors["tile_cut"]
    )
    assert "inside a block" in errors["tile_cut"]
    assert "no dim in common" in errors["same_dims"]
    assert "split by tensor or expert parallelism" in errors["shampoo"]  # not silently wrong
    assert "global shape [5, 8]" in errors["muon_uneven"]
    assert "unevenly (5 is not a multiple of 2)" in errors["muon_uneven"]


def test_muon_orthogonalises_whole_matrices_as_one_device(grid):
    """The same whole gradients: bitwise torch's Muon and AdamW on one device, with FSDP over
    dp and without; orthogonalising each tensor-parallel slice alone is not."""
    for rank in grid:
        muon = rank["muon"]
        for kind in ("rf", "tp_only"):
            assert muon[kind].keys() == muon["reference"].keys()
            for key, value in muon["reference"].items():
                assert torch.equal(muon[kind][key], value), (kind, key)
        for key in ("blocks.0.up.weight", "blocks.1.down.weight"):  # split by rows, by columns
            moved = (muon["slices"][key] - muon["reference"][key]).abs().max()
            assert moved > 1e-4, key


def test_subclass_local_tensors_beside_tensor_parallelism_train_as_fsdp2(grid):
    """DTensor weights over tp (Shard(0), Shard(1)) whose local tensors are fp8-cast subclasses,
    sharded over dp: they keep both placements and the class, travel as fp8 codes and fp32
    scales (the protocol followed, not the fp32 data gathered), and train to FSDP2's numbers;
    the fp8 cast matters (plain fp32 weights end elsewhere: the negative control)."""
    for rank in grid:
        got = rank["subclass"]
        assert got["rf/placements"] == [["RS", str(Shard(0))], ["RS", str(Shard(1))]]
        assert got["rf/classes"] == got["fsdp2/classes"] == ["Fp8CastWeight"] * 2
        # per gather, both weights' tp-local codes (16 x 8 and 8 x 16) and one scale a row
        fp8, fp32 = got["rf/bytes"]["torch.float8_e4m3fn"], got["rf/bytes"]["torch.float32"]
        gathers = fp8 // (2 * 16 * 8)
        assert gathers >= 3 and fp8 == gathers * 2 * 16 * 8 and fp32 == gathers * 4 * (16 + 8)
        assert_close_dicts(got["rf"], got["fsdp2"])
        assert got["rf/norm"] == pytest.approx(got["fsdp2/norm"], rel=1e-6)
        moved = (got["rf"]["up.weight"] - got["rf_fp32"]["up.weight"]).abs().max()
        assert moved > 1e-3


def test_subclass_local_tensors_beside_tensor_parallelism_go_through_dcp(grid):
    """raggedfsdp's trained tp x dp block with fp8-cast local tensors, saved by DCP and loaded
    into a block of other values (the negative control: it differed): bit for bit, the class
    kept."""
    for rank in grid:
        got = rank["subclass"]
        assert got["dcp/classes"] == ["Fp8CastWeight"] * 2
        for key, want in got["rf"].items():
            assert (got["dcp/before"][key] - want).abs().max() > 1e-3, key
            assert torch.equal(got["dcp/loaded"][key], want), key
