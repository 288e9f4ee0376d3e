"""Every member of a communicator issues the same sequence of collectives: kind, dtype and sizes
(``collective_wrap.Recorder``). NCCL matches collectives by their order alone, with no tags to
hide a mismatch, so a rank-dependent call hangs or corrupts a run on GPUs where Gloo's tagged
point-to-point transfers would not notice.

One launch of 4 ranks records a few training steps per configuration (plain, bf16, compressed,
gradient accumulation, HSDP 2 x 2) on both branches (NCCL's calls, and Gloo's point to point);
a negative control plants a rank-dependent extra collective, on a communicator of its own so
that nothing waits for it. A second control, in this process, plants one that NCCL would hang
on, on torch's fake process group (``fake_ranks.py``), where nothing can hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import raggedfsdp as rf
from collective_wrap import Record, first_difference, recording
from fake_ranks import fake_world
from harness import run_distributed
from parity_models import OddModel, make_batches

pytestmark = pytest.mark.slow

WORLD, STEPS, GLOBAL_BATCH = 4, 2, 8
#: name -> (mixed precision, compression, micro-batches, HSDP)
CASES = {
    "plain": (None, None, 1, False),
    "bf16": (rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16), None, 1, False),
    "compressed": (
        None,
        rf.CommCompression(all_gather=torch.int8, reduce_scatter=torch.int8),
        1,
        False,
    ),
    "accumulation": (None, None, 2, False),
    "hsdp": (None, None, 1, True),
}


def _train(rank: int, world: int, case: tuple, *, native: bool, plant=None) -> None:
    """``STEPS`` steps of OddModel; ``plant(step)`` runs before each step's forward."""
    mp, compression, micro, hsdp = case
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = OddModel()
    rf.FSDPBackend(
        model,
        shard_policy=rf.RaggedShard(block_size=4),
        mesh=mesh,
        mp_policy=mp,
        compression=compression,
        dbuffer_config=rf.DBufferConfig(gloo_point_to_point=not native),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per = GLOBAL_BATCH // world
    for step, (idx, targets) in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        if plant is not None:
            plant(step)
        opt.zero_grad()
        chunks = zip(
            idx[rank * per : (rank + 1) * per].chunk(micro),
            targets[rank * per : (rank + 1) * per].chunk(micro),
            strict=True,
        )
        for i, (x, y) in enumerate(chunks):
            model.set_requires_gradient_sync(i == micro - 1)
            model(x, y).backward()
        opt.step()


def _sequences(rank: int, world: int) -> dict[str, list[Record]]:
    """This rank's calls per case and branch, and in a run with a planted extra call."""
    out = {}
    for name, case in CASES.items():
        for native in (True, False):
            with recording() as recorder:
                _train(rank, world, case, native=native)
            out[f"{name}-{'native' if native else 'point-to-point'}"] = recorder.take()
    # Made by every rank (new_group is collective); only rank 0 ever calls on it, and nobody
    # waits for that call, so it cannot hold the launch up.
    solitary = dist.new_group(list(range(world)))

    def plant(step: int) -> None:
        if step == 1 and rank == 0:
            dist.all_reduce(torch.zeros(1), group=solitary, async_op=True)

    with recording() as recorder:
        _train(rank, world, CASES["plain"], native=True, plant=plant)
    out["planted"] = recorder.take()
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[str, list[Record]]]:
    return run_distributed(_sequences, WORLD)


def test_every_member_issues_the_same_sequence(grid):
    for case in grid[0]:
        if case == "planted":
            continue
        per_rank = {rank: results[case] for rank, results in enumerate(grid)}
        assert all(per_rank.values()), case
        assert first_difference(per_rank) is None, case
        kinds = {record.kind for records in per_rank.values() for record in records}
        if case.endswith("-native"):
            # The bucket collectives are NCCL's; the plans' check at the first forward is
            # still point to point on Gloo (it does not read DBufferConfig).
            assert kinds & {"all_gather", "reduce_scatter", "all_to_all"}, (case, kinds)
        if case.startswith("hsdp"):
            assert "all_reduce" in kinds, case


def test_negative_control_rank_dependent_extra_collective_is_caught(grid):
    per_rank = {rank: results["planted"] for rank, results in enumerate(grid)}
    difference = first_difference(per_rank)
    assert difference is not None
    assert "rank 0 issued 1 calls, rank 1 0" in difference, difference


def _step_on_fake_rank(rank: int, world: int) -> list[Record]:
    """One step of OddModel as rank ``rank`` of ``world`` on the fake backend, rank 1 issuing
    one all-reduce more than the others (NCCL would hang on it)."""
    with fake_world(rank, world), recording() as recorder:
        torch.manual_seed(0)
        model = OddModel()
        rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4))
        idx, targets = make_batches(1, 2)[0]
        if rank == 1:
            dist.all_reduce(torch.zeros(1))
        model(idx, targets).backward()
        return recorder.take()


def test_negative_control_on_the_fake_backend():
    per_rank = {rank: _step_on_fake_rank(rank, 8) for rank in (0, 1, 7)}
    difference = first_difference(per_rank)
    assert difference is not None
    assert "call 0: rank 0 issued all_gather" in difference, difference
    assert "rank 1 all_reduce(torch.float32, 1 -> 1)" in difference, difference
    del per_rank[1]
    assert first_difference(per_rank) is None
