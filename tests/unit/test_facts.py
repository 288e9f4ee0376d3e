"""The room of shared facts (``raggedfsdp/facts``), pure logic: the degrees' noun and its errors,
the one tensor-parallel split table both its users read, and the one cut rule checked element by
element against what the runtime does to a split tensor. What raggedfsdp's system description
says is held to the runtime's records in tests/distributed/test_facts_conformance.py."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from raggedfsdp import capacity
from raggedfsdp.capacity.parallel import UnsplittableModel, split_model
from raggedfsdp.facts import (
    TP_PLAN,
    ParallelDims,
    TPStyle,
    check_cut,
    first_cut_inside_block,
    tp_dim,
)
from raggedfsdp.layout import RaggedShard, row_numel
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.models import tensor_parallel as model_tp
from raggedfsdp.runtime.fully_shard import _check_parallel_cuts
from raggedfsdp.train.mesh import JobMesh

# -- the degrees ----------------------------------------------------------------------------------


def test_degrees_resolve_at_a_world_size_as_torchtitan_does():
    dims = ParallelDims(tp=2, ep=2)
    assert not dims.resolved and dims.model_parallel == 4 and dims.world_multiple == 4
    at = dims.at_world(16)
    assert (at.dp_shard, at.world_size, at.dp, at.dp_shard_mod_ep) == (8, 16, 8, 4)
    assert at.at_world(16) is at
    hsdp = ParallelDims(dp_replicate=2, tp=2).at_world(16)
    assert (hsdp.dp_shard, hsdp.dp, hsdp.dp_shard_mod_ep) == (4, 8, 4)
    given = ParallelDims(dp_shard=4, cp=2, pp=2)
    assert given.resolved and given.world_size == 16 and given.dp == 4
    assert capacity.ParallelDims is ParallelDims  # capacity, train and cli read the one noun


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ParallelDims(tp=0), "tp must be a positive integer, got 0"),
        (lambda: ParallelDims(ep=True), "ep must be a positive integer, got True"),
        (lambda: ParallelDims(pp=1.5), "pp must be a positive integer, got 1.5"),
        (lambda: ParallelDims(dp_shard=0), r"dp_shard must be a positive integer \(or -1"),
        (lambda: ParallelDims(dp_shard=6, ep=4), "ep=4 does not divide dp_shard=6"),
        (
            lambda: ParallelDims(tp=3, ep=2).at_world(8),
            r"tp=3 x ep=2 = 6 does not divide the world size 8: the ranks form a dp x ep x tp ",
        ),
        (
            lambda: ParallelDims(tp=2, pp=2).at_world(6),
            r"tp=2 x pp=2 x ep=1 = 4 does not divide the world size 6: the ranks form a pp x dp "
            r"x ep x tp mesh",
        ),
        (
            lambda: ParallelDims(dp_replicate=2, tp=2).at_world(6),
            r"dp_replicate=2 x tp=2 x ep=1 = 4 does not divide the world size 6: the ranks form "
            r"a dp_replicate x dp x ep x tp mesh",
        ),
        (lambda: ParallelDims(dp_shard=2, tp=2).at_world(8), "spans 4 ranks, not the world"),
        (lambda: ParallelDims(tp=2).dp, r"dp of ParallelDims\(dp_shard=auto, tp=2\) needs a"),
        (lambda: ParallelDims().at_world(0), "world size must be a positive integer"),
        (lambda: ParallelDims(2), "positional"),  # keywords only: no degree taken for another
    ],
)
def test_bad_degrees_are_named(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_the_job_mesh_holds_the_noun():
    mesh = JobMesh(8, 5, tp=2)
    assert mesh.dims == ParallelDims(tp=2).at_world(8)
    assert (mesh.world, mesh.dp, mesh.data_ranks, mesh.data_rank) == (8, 4, 4, 2)
    ep = JobMesh(8, ep=2)
    assert (ep.dp, ep.data_ranks, ep.describe()) == (4, 8, {"dp": 4, "ep": 2})
    with pytest.raises(ValueError, match="tp=2 x ep=2 = 4 does not divide the world size 6"):
        JobMesh(6, tp=2, ep=2)
    with pytest.raises(ValueError, match="not both at once"):
        JobMesh(8, tp=2, ep=2)


def test_capacity_refuses_degrees_it_does_not_model():
    model = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    with pytest.raises(UnsplittableModel, match="pp=2: the capacity planner models"):
        split_model(model, ParallelDims(tp=2, pp=2))


# -- the split table ------------------------------------------------------------------------------


def test_the_job_and_the_cost_model_read_one_table():
    """The job's parallelize_module plan for a GPT block and the capacity planner's split of
    the same model come from the table: each projection's style, and the dim it splits."""
    model = GPT(GPT_CONFIGS["gpt-tiny"], device="meta")
    _, plan = model_tp._blocks_and_plan(model)
    assert plan == {path: TP_PLAN[path.rsplit(".", 1)[-1]] for path in plan}
    assert {style for style in plan.values()} == {TPStyle.COLWISE, TPStyle.ROWWISE}
    split = split_model(model, ParallelDims(tp=2))
    for path, style in plan.items():
        for kind in ("weight", "bias"):
            name = f"blocks.0.{path}.{kind}"
            if name in split.params:
                assert split.params[name].tp_dim == tp_dim(style, bias=kind == "bias"), name
    assert split.params["tok_emb.weight"].tp_dim == 0  # vocabulary-parallel (tied to the head)


def test_a_module_the_table_does_not_name_is_refused_with_the_table():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_heads = 2
            self.mixer = nn.Linear(4, 4)

    with pytest.raises(UnsplittableModel, match=r"module named 'mixer' \(column-parallel: .*fc"):
        split_model(Odd(), ParallelDims(tp=2))


# -- the cut rule ---------------------------------------------------------------------------------


def _tiles(shape: tuple[int, ...], block: object) -> torch.Tensor:
    """The id of the policy block (tile) each element lies in, over the ``[rows, row]`` view:
    ``b x b`` tiles for ``b`` rows, ``(rows, cols)`` tiles, the whole tensor, or elements."""
    numel, row = math.prod(shape), row_numel(shape)
    rows = numel // row
    if block is None:
        tr, tc = 1, 1
    elif block == "whole":
        tr, tc = rows, row
    elif isinstance(block, tuple):
        tr, tc = block
    else:
        tr, tc = block, block
    r = torch.arange(rows)[:, None] // tr
    c = torch.arange(row)[None, :] // tc
    return (r * (row + 1) + c).reshape(shape)


def _keeps_blocks_whole(shape: tuple[int, ...], dim: int, ways: int, block: object) -> bool:
    """What the runtime does, element by element: the tensor split by ``torch.chunk`` (as
    ``Shard(dim)``), each rank's piece planned with the policy's units over its own shape. The
    split keeps the policy's blocks whole iff every block lies in one rank's piece and, there,
    in one unit (which no shard cuts); a piece the policy refuses to plan keeps nothing whole."""
    policy = RaggedShard(block_size=block)
    homes: dict[int, set[tuple[int, int]]] = {}
    for rank, piece in enumerate(torch.chunk(_tiles(shape, block), ways, dim)):
        try:
            unit = policy.unit_numel("w", piece.shape)
        except ValueError:  # a piece the policy cannot cut (tile columns across its row)
            return False
        for at, tile in enumerate(piece.reshape(-1).tolist()):
            homes.setdefault(tile, set()).add((rank, at // unit))
    return all(len(places) == 1 for places in homes.values())


SHAPES = [(12,), (8, 12), (12, 8), (10, 8), (2, 8, 12), (2, 6, 4), (2, 5, 4), (3, 10, 8)]
BLOCKS = [None, 2, 3, 4, (2, 4), (4, 2), "whole"]


def test_the_cut_rule_is_what_the_runtime_does_to_the_tensor():
    """Every shape, dim, degree and block of the grid: the rule refuses exactly the splits that
    cut a block, by the element-by-element reference. Blocks whose columns do not divide a
    row are not policies of that shape (the layout refuses them) and are skipped."""
    checked = refused = 0
    for shape, block, ways in itertools.product(SHAPES, BLOCKS, (2, 3, 4)):
        policy = RaggedShard(block_size=block)
        try:
            policy.unit_numel("w", shape)
        except ValueError:
            continue
        for dim in range(len(shape)):
            if shape[dim] < ways:
                continue
            want = _keeps_blocks_whole(shape, dim, ways, block)
            got = first_cut_inside_block("w", shape, dim, ways, policy) is None
            assert got == want, (shape, dim, ways, block)
            checked += 1
            refused += not want
    assert checked > 200 and 50 < refused < checked  # both answers, many times


@pytest.mark.parametrize(
    ("shape", "block", "ok", "runtime_before"),
    [
        # [E, out, in] split on out (w1 / w3 of a fused stack) by 4x16 tiles: each rank holds
        # whole 4-row tiles. fully_shard used to treat dim 1 as columns and refuse (4 % 16).
        ((2, 8, 32), (4, 16), True, False),
        # 3-row blocks of the [E*out, in] view straddle the two experts (5 rows each), and
        # splitting out cuts every expert at its start: a block is cut. fully_shard used to
        # check 3 % 3 on the cut alone and accept.
        ((2, 5, 4), 3, False, True),
    ],
)
def test_an_expert_stack_split_on_its_middle_dim(shape, block, ok, runtime_before):
    """Where the two copies differed (the capacity planner's rule was right): the reference
    and the one rule agree, and fully_shard now refuses exactly what the rule refuses."""
    policy = RaggedShard(block_size=block)
    assert _keeps_blocks_whole(shape, 1, 2, block) is ok is not runtime_before
    assert (first_cut_inside_block("experts.w1", shape, 1, 2, policy) is None) is ok
    spec = SimpleNamespace(
        shape=torch.Size(shape),
        placements=(Shard(1), Replicate()),
        mesh=SimpleNamespace(size=lambda dim: 2),
    )
    registration = SimpleNamespace(fqn="experts.w1", placement=SimpleNamespace(split=spec))
    if ok:
        _check_parallel_cuts(registration, policy)  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match=r"split by Shard\(dim=1\) over 2 ranks at index 3"):
            _check_parallel_cuts(registration, policy)  # type: ignore[arg-type]
        with pytest.raises(UnsplittableModel, match="inside a block"):
            check_cut("w", shape, 1, 2, policy, by="tp", error=UnsplittableModel)
