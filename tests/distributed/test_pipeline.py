"""raggedfsdp units inside torch's ``PipelineStage``, under every schedule the installed torch has,
against one process on the global batch and against FSDP2 + PP in the same launch.

One Gloo launch of 8 ranks: pp x HSDP and pp x dp x tp on all 8, then a mesh (pp=2, dp=2) on ranks
0-3 as a launch of its own (``run_world_grid``'s ``as_launches``): a small decoder with uneven
widths (37, 24, 40) cut into stages torchtitan's way (``tests/support/pipeline_cases.py``), 2 SGD
steps of 4 micro-batches. Optimizers, clipping over the stages and DCP across layouts ride in the
4-rank part. The tests judge the collected results.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import raggedfsdp as rf
from harness import Grid, error_message, run_world_grid
from optim_grid import structured_optimizer, structured_planner
from pipeline_cases import (
    DP,
    LR,
    MICROBATCHES,
    PP,
    SCHEDULES,
    SEQ,
    SPLIT_BACKWARD,
    Decoder,
    batches,
    build,
    cut,
    full_params,
    initial_model,
    max_difference,
    reference,
    step,
    train_pipeline,
)
from raggedfsdp.capacity import CapacityOptions, PipelineSchedule, hardware, plan_pipeline

CLIP = 0.5  # below the gradients' norm: clipping scales them
OPTIMIZERS = ("muon", "shampoo", "adamw8bit")


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """Muon's AdamW takes the embeddings and the head."""
    return structured_optimizer(kind, model, lambda n: "emb" in n or "head" in n, 256)


def optimizer_twins(kind: str, mesh: DeviceMesh) -> float:
    """``kind`` on each stage's shards (planned for it) against the same optimizer on an
    unsharded copy of the stage given the same gradients, gathered whole: the largest difference
    of their parameters after 2 steps (1F1B, torchtitan's settings)."""
    planner = structured_planner(kind)
    parts, run, mine, stages = build("rf", "Schedule1F1B", mesh, titan=True, planner=planner)
    twins = [cut(initial_model(), index, stages) for index in mine]
    opts = [_optimizer(kind, m) for m in parts + twins]
    dp = mesh["dp"].get_group()
    for x, y in batches():
        step(run, mine, stages, mesh, x, y)
        for part, twin in zip(parts, twins, strict=True):
            twin_params = dict(twin.named_parameters())
            for name, p in part.named_parameters():
                layout = rf.shard_info(p).layout
                pieces: list[Any] = [None] * layout.world_size
                dist.all_gather_object(pieces, p.grad.to_local().detach().clone(), group=dp)
                twin_params[name].grad = layout.from_locals(pieces)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ours = full_params(parts)
    theirs = {k: v for twin in twins for k, v in twin.state_dict().items()}
    return max_difference(ours, theirs)


def checkpoint_cases(mesh: DeviceMesh) -> dict[str, Any]:
    """DCP per stage: saved after a step at (pp=2, dp=2), loaded at (pp=1, dp=2) and (pp=2,
    dp=1) on ranks 0 and 1, and into FSDP2 + PP at (pp=2, dp=2): the full parameters saved, and
    those of each load before and after it."""
    rank = dist.get_rank()
    where = [tempfile.mkdtemp(prefix="raggedfsdp-pp-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    path = where[0]
    parts, run, mine, stages = build("rf", "Schedule1F1B", mesh, titan=True)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=LR)
    step(run, mine, stages, mesh, *batches()[0])
    opt.step()
    state: dict[str, Any] = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    dcp.save(state, checkpoint_id=path)
    out: dict[str, Any] = {"saved": full_params(parts)}
    pair = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    if rank < 2:
        out["pp1_dp2"] = load_stages("rf", [0], 1, DeviceMesh.from_group(pair, "cpu"), path, pair)
        one = DeviceMesh.from_group(alone[rank], "cpu")
        out["pp2_dp1"] = load_stages("rf", [rank], PP, one, path, pair)
    out["fsdp2"] = load_stages("torch", mine, stages, mesh["dp"], path, None)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    return out


def load_stages(
    impl: str, indices: list[int], stages: int, dp_mesh: DeviceMesh, path: str, group: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """Stages ``indices`` of ``stages``, drawn afresh and sharded over ``dp_mesh``, loaded from
    the checkpoint at ``path`` (by the ranks of ``group``): their parameters before and after."""
    fully_shard = rf.fully_shard if impl == "rf" else torch_fully_shard
    torch.manual_seed(123)  # other values than the checkpoint's
    full = Decoder()
    parts = []
    for index in indices:
        part = cut(full, index, stages)
        for layer in part.layers.values():
            fully_shard(layer, mesh=dp_mesh)
        parts.append(fully_shard(part, mesh=dp_mesh))
    before = full_params(parts)
    for part in parts:
        state = get_model_state_dict(part)
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_model_state_dict(part, state)
    return {"before": before, "after": full_params(parts)}


def _cases(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for impl in ("rf", "torch"):
            out[impl, schedule, "titan"] = train_pipeline(impl, schedule, mesh, titan=True)
        if schedule not in SPLIT_BACKWARD:
            out["rf", schedule, "defaults"] = train_pipeline("rf", schedule, titan=False, mesh=mesh)
    part = rf.fully_shard(cut(initial_model(), 1, PP), mesh=mesh["dp"])
    out["state"] = [
        type(fully_shard.state(m)).__name__
        for fully_shard in (torch_fully_shard, rf.fully_shard)
        for m in (part, next(iter(part.layers.values())))
    ]
    out["rf", "ScheduleGPipe", "double_scaled"] = train_pipeline(
        "rf", "ScheduleGPipe", mesh, titan=False, double_scaled=True
    )
    tp = init_device_mesh("cpu", (PP, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    out["rf", "Schedule1F1B", "tp"] = train_pipeline("rf", "Schedule1F1B", tp, titan=True)
    out["clipped"] = train_pipeline("rf", "ScheduleInterleaved1F1B", mesh, titan=True, clip=CLIP)
    out["clip_error"] = error_message(lambda: rf.clip_grad_norm_([], 1.0, pp_mesh=mesh))
    out["optimizers"] = {kind: optimizer_twins(kind, mesh) for kind in OPTIMIZERS}
    out["checkpoint"] = checkpoint_cases(mesh)
    return out


def _cases_8(rank: int, world: int) -> dict[str, Any]:
    """The 8-rank meshes: pp=2 x HSDP (2 replicas of 2 shards), pp=2 x dp=2 x tp=2."""
    meshes = {
        "hsdp": init_device_mesh(
            "cpu", (PP, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard")
        ),
        "dp_tp": init_device_mesh("cpu", (PP, 2, 2), mesh_dim_names=("pp", "dp", "tp")),
    }
    schedule = {"hsdp": "Schedule1F1B", "dp_tp": "ScheduleInterleaved1F1B"}
    return {
        (impl, name): train_pipeline(impl, schedule[name], mesh, titan=True, microbatches=2)
        for name, mesh in meshes.items()
        for impl in ("rf", "torch")
    }


def _by_world(rank: int, world: int, group: None) -> dict[str, Any]:
    return _cases_8(rank, world) if world == 8 else _cases(rank, world)


@pytest.fixture(scope="module")
def worlds() -> Grid:
    """One launch of 8 ranks: the 8-rank meshes first, then (ranks 4-7 done and gone) the
    4-rank cases on ranks 0-3, in a default group of their own."""
    return run_world_grid(_by_world, [8, PP * DP], as_launches=True)


@pytest.fixture(scope="module")
def grid(worlds: Grid) -> list[dict[str, Any]]:
    return worlds[PP * DP]


@pytest.fixture(scope="module")
def grid_8(worlds: Grid) -> list[dict[str, Any]]:
    return worlds[8]


def gathered(grid: list[dict[str, Any]], key: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The parameters of every stage of a case, by the full model's names."""
    params: dict[str, torch.Tensor] = {}
    for rank in grid:
        params.update(rank[key]["params"])
    return params


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_trains_as_one_process_and_as_fsdp2(grid, schedule):
    want = reference()[0]
    ours = gathered(grid, ("rf", schedule, "titan"))
    theirs = gathered(grid, ("torch", schedule, "titan"))
    assert max_difference(ours, want) < 1e-5
    assert max_difference(theirs, want) < 1e-5  # FSDP2 + PP, the same launch
    assert max_difference(ours, theirs) < 1e-5


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in SPLIT_BACKWARD])
def test_torch_defaults_train_as_one_process(grid, schedule):
    assert max_difference(gathered(grid, ("rf", schedule, "defaults")), reference()[0]) < 1e-5


def test_a_wrong_gradient_scale_is_seen(grid):
    """Negative control: the loss divided by the micro-batches twice is 4x off, and seen."""
    assert (
        max_difference(gathered(grid, ("rf", "ScheduleGPipe", "double_scaled")), reference()[0])
        > 1e-3
    )


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gradients_reduced_once_per_unit_per_step(grid, schedule):
    """Step 2 (step 1 also runs torch's metadata inference, a forward and backward of its own):
    one reduce-scatter per bucket of each stage, not one per micro-batch; with no reshard after
    forward one all-gather per bucket, the one the schedule's UNSHARD (or the first forward)
    issued."""
    for rank in grid:
        for stage in rank["rf", schedule, "titan"]["counts"][-1]:
            assert stage["reduce_scatters"] == stage["buckets"]
            assert stage["all_gathers"] == stage["buckets"]


def test_capacity_model_predicts_each_stages_unsharded_bytes(grid):
    """``raggedfsdp plan --pp``'s model (:func:`raggedfsdp.capacity.plan_pipeline`) against the
    runtime's high-water mark of unsharded bytes in step 2 of 1F1B with torchtitan's settings:
    each stage holds every unit's parameters and gradient block for the whole step (no reshard
    after forward, gradients accumulated over the micro-batches), which the model predicts, and
    at the step's end one block's Gloo reduce-scatter receive buffer beside them (``(W - 1) S``
    fp32, a layer's shard from the other data rank), which it leaves out of ``unsharded``."""
    hw, options = hardware("cpu-gloo"), CapacityOptions(batch=1, seq_len=SEQ)
    schedule = PipelineSchedule("1f1b", PP, MICROBATCHES)
    model = plan_pipeline(initial_model(), PP * DP, hw, options, schedule)["raggedfsdp"]
    layer = sum(p.numel() for p in Decoder().layers["0"].parameters())
    receive = (DP - 1) * layer // DP * 4
    for index, rank in enumerate(grid):
        (stage,) = rank["rf", "Schedule1F1B", "titan"]["counts"][-1]
        predicted = model.ranks[index // DP]  # the mesh is (pp, dp): pp outermost
        assert stage["peak_unsharded_bytes"] == predicted.unsharded + receive, index


def test_fully_shard_state_finds_raggedfsdp_units(grid):
    """torch's ``fully_shard.state(module)`` (what its pipelining reads) and raggedfsdp's: the
    unit's torch-facing state on a sharded module, ``None`` on one not sharded."""
    assert grid[0]["state"] == ["TorchFacingState", "NoneType"] * 2


def test_clipping_over_all_stages_gives_one_process_norm(grid):
    """``rf.clip_grad_norm_(stage parameters, pp_mesh=...)`` on every stage (two per rank,
    Interleaved1F1B): one process's norm of the whole model's gradients, every step, and its
    parameters."""
    want, norms = reference(clip=CLIP)
    assert min(norms) > CLIP  # clipping acts
    for rank in grid:
        torch.testing.assert_close(rank["clipped"]["norms"], norms, rtol=1e-5, atol=0)
    got = {}
    for rank in grid:
        got.update(rank["clipped"]["params"])
    assert max_difference(got, want) < 1e-5
    # bad input: the 2-D (pp, dp) mesh, refused before any collective
    assert (
        grid[0]["clip_error"] == "pp_mesh must be the 1-D mesh over the pipeline stages, got 2 dims"
    )


def test_optimizers_on_each_stage_match_one_device_bitwise(grid):
    """Muon, Shampoo and AdamW8bit on each stage's ragged shards, given the gradients the
    pipeline reduced: bit for bit the same optimizer on one device given those gradients whole."""
    for rank in grid:
        assert rank["optimizers"]["muon"] == 0.0
        assert rank["optimizers"]["adamw8bit"] == 0.0
        # raggedfsdp's promise for Shampoo is fp32 round-off (docs/optimizers.md)
        assert rank["optimizers"]["shampoo"] <= 1e-7


@pytest.mark.parametrize("load", ["pp1_dp2", "pp2_dp1", "fsdp2"])
def test_a_stage_checkpoint_loads_at_another_layout_bit_for_bit(grid, load):
    """Saved at (pp=2, dp=2) by DCP, one stage per rank: loaded at (pp=1, dp=2), at (pp=2, dp=1)
    and into FSDP2 + PP, every parameter equal bit for bit; none was before the load."""
    saved: dict[str, torch.Tensor] = {}
    for rank in grid:
        saved.update(rank["checkpoint"]["saved"])
    loaders = grid[:2] if load != "fsdp2" else grid
    got: dict[str, dict[str, torch.Tensor]] = {"before": {}, "after": {}}
    for rank in loaders:
        for when in got:
            got[when].update(rank["checkpoint"][load][when])
    assert got["after"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(got["after"][name], value), name
        assert not torch.equal(got["before"][name], value), name


def test_pp_x_tp_trains_as_one_process(grid):
    """4 ranks, pp=2 x tp=2 (dp=1): blocks split column- then row-wise inside each stage."""
    assert max_difference(gathered(grid, ("rf", "Schedule1F1B", "tp")), reference()[0]) < 1e-5


@pytest.mark.parametrize("mesh", ["hsdp", "dp_tp"])
def test_8_rank_meshes_train_as_one_process_and_as_fsdp2(grid_8, mesh):
    """pp=2 x HSDP(2 x 2) under 1F1B, pp=2 x dp=2 x tp=2 under Interleaved1F1B (2 micro-batches
    per data rank): one process and FSDP2 + PP within 1e-5; per step and bucket one
    reduce-scatter, and under HSDP one all-reduce over the replicas."""
    want = reference()[0]
    ours, theirs = gathered(grid_8, ("rf", mesh)), gathered(grid_8, ("torch", mesh))
    assert max_difference(ours, want) < 1e-5
    assert max_difference(theirs, want) < 1e-5
    for rank in grid_8:
        for stage in rank["rf", mesh]["counts"][-1]:
            assert stage["reduce_scatters"] == stage["buckets"]
            assert stage["all_reduces"] == (stage["buckets"] if mesh == "hsdp" else 0)
