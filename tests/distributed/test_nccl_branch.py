"""NCCL's asynchrony emulated on Gloo (``collective_wrap.emulated_asynchrony``): what the
emulation does to a collective, that it changes nothing in a correct run, and that a planted
use-before-wait fails (the negative controls). One launch of 2 ranks runs every case; the
parity and compression grids run their NCCL-branch cases under the same emulation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import raggedfsdp as rf
from collective_wrap import AsyncEmulation, emulated_asynchrony, emulated_when
from harness import run_distributed
from parity_models import OddModel, make_batches
from raggedfsdp.runtime._metrics import RuntimeStats
from raggedfsdp.runtime._pool import BufferPool
from raggedfsdp.runtime._transport import all_gather_tensor

pytestmark = pytest.mark.slow

WORLD, STEPS, GLOBAL_BATCH = 2, 2, 8
INT8 = torch.int8

#: Training cases, each run with and without the emulation: (native, compression, HSDP).
CASES = {
    "point-to-point": (False, None, False),
    "point-to-point-compressed": (
        False,
        rf.CommCompression(all_gather=INT8, reduce_scatter=INT8),
        False,
    ),
    "point-to-point-hsdp": (False, None, True),
    "native-hsdp": (True, None, True),
}
#: Planted use-before-wait per kind of call, on a case that issues it.
PLANTED = {
    "all_gather": "native",
    "reduce_scatter": "native",
    "all_to_all": "native-compressed",
    "all_reduce": "native-hsdp",
    "recv": "point-to-point",
}
PLANT_CASES = {
    "native": (True, None, False),
    "native-compressed": (True, rf.CommCompression(reduce_scatter=INT8), False),
    "native-hsdp": (True, None, True),
    "point-to-point": (False, None, False),
}


def _train(rank: int, world: int, case: tuple, base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``STEPS`` AdamW steps of ``base`` sharded over the world (HSDP: a 2 x 1 mesh, whose
    all-reduce over the replicas does all the averaging); the full parameters after them."""
    native, compression, hsdp = case
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(base)
    rf.FSDPBackend(
        model,
        shard_policy=rf.RaggedShard(block_size=4),
        compression=compression,
        mesh=mesh,
        dbuffer_config=rf.DBufferConfig(gloo_point_to_point=not native),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per = GLOBAL_BATCH // world
    for idx, targets in make_batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        model(idx[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]).backward()
        opt.step()
    return rf.full_state_dict(model)


# -- what the emulation does to one collective ---------------------------------------------------


def _one_collective(rank: int, world: int) -> dict[str, object]:
    """The emulation on direct calls, through the runtime's own entry to torch's all-gather."""
    out: dict[str, object] = {}
    shard = torch.full((4,), float(rank + 1))
    full = torch.zeros(4 * world)
    gathered = [float(k + 1) for k in range(world) for _ in range(4)]
    with emulated_asynchrony() as emulation:
        work = all_gather_tensor(full, shard, async_op=True)
        out["poisoned_before_wait"] = bool(torch.isnan(full).all())
        work.wait()
        out["delivered_at_wait"] = full.tolist() == gathered
        # In place: the input is this rank's slot of the output, and stays readable.
        slot = full[4 * rank : 4 * (rank + 1)]
        work = all_gather_tensor(full, slot, async_op=True)
        out["slot_kept"] = bool((slot == rank + 1).all()) and int(torch.isnan(full).sum()) == 4
        work.wait()
        out["violations_so_far"] = list(emulation.violations)
        _misuse(emulation, shard, full)
        out["violations"] = emulation.violations[len(out["violations_so_far"]) :]
        out["unwaited"] = _unwaited(emulation, full)
        pool = BufferPool(RuntimeStats())
        block = pool.take(8, torch.float32, torch.device("cpu"))
        block.fill_(1.0)
        pool.give(block)
        out["pool_block_poisoned"] = bool(torch.isnan(block).all())
    return out


def _misuse(emulation: AsyncEmulation, shard: torch.Tensor, full: torch.Tensor) -> None:
    """Two calls misused: the input changed, then the output written, before wait()."""
    work = all_gather_tensor(full, shard, async_op=True)
    shard.add_(1.0)
    work.wait()
    work = dist.all_reduce(shard, async_op=True)
    shard.zero_()
    work.wait()


def _unwaited(emulation: AsyncEmulation, full: torch.Tensor) -> list[int]:
    """The count of calls never waited for, with one in flight and after its wait."""
    counts = [emulation.unwaited]
    work = all_gather_tensor(full, torch.ones(4), async_op=True)
    counts.append(emulation.unwaited)
    work.wait()
    counts.append(emulation.unwaited)
    return counts


# -- correct runs, and planted bugs --------------------------------------------------------------


def _transparent(rank: int, world: int) -> dict[str, object]:
    """Per case: whether the emulated run equals the plain one bit for bit (the same calls in
    the same order: only when the data land differs), and what the emulation reports. (The
    parity grid compares both branches with one process.)"""
    torch.manual_seed(0)
    base = OddModel()
    out: dict[str, object] = {}
    for name, case in CASES.items():
        plain = _train(rank, world, case, base)
        with emulated_asynchrony() as emulation:
            emulated = _train(rank, world, case, base)
        same = all(torch.equal(plain[k], emulated[k]) for k in plain)
        out[name] = (same, emulation.failure(), emulation.issued)
    return out


def _planted(rank: int, world: int) -> dict[str, tuple[str, int]]:
    """Per kind of call: how the run with a use-before-wait planted on that kind failed (or
    ``"missed"``), and how many waits the plant hit."""
    torch.manual_seed(0)
    base = OddModel()
    out = {}
    for kind, case_name in PLANTED.items():
        case = PLANT_CASES[case_name]
        clean = _train(rank, world, case, base)
        with emulated_asynchrony(use_before_wait=(kind,)) as emulation:
            try:
                got = _train(rank, world, case, base)
            except (ValueError, RuntimeError) as e:
                out[kind] = (f"raised: {str(e)[:120]}", emulation.planted)
                continue
        if not all(bool(torch.isfinite(v).all()) for v in got.values()):
            outcome = "non-finite parameters"
        elif any(not torch.equal(got[k], clean[k]) for k in clean):
            outcome = "different parameters"
        else:
            outcome = "missed"
        out[kind] = (outcome, emulation.planted)
    return out


def _all_cases(rank: int, world: int) -> dict[str, object]:
    return {
        "one": _one_collective(rank, world),
        "transparent": _transparent(rank, world),
        # The plants last: a run that raised leaves nothing the others need.
        "planted": _planted(rank, world),
    }


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return run_distributed(_all_cases, WORLD)


def test_outputs_are_poison_until_wait_and_misuse_is_reported(grid):
    for rank, results in enumerate(grid):
        one = results["one"]
        assert one["poisoned_before_wait"] and one["delivered_at_wait"], (rank, one)
        assert one["slot_kept"], (rank, one)
        assert one["violations_so_far"] == [], (rank, one)
        assert one["violations"] == [
            "all_gather of 8 x torch.float32: its input changed before wait()",
            "all_reduce of 4 x torch.float32: its output was written before wait()",
        ], (rank, one)
        assert one["unwaited"] == [0, 1, 0]
        assert one["pool_block_poisoned"]


def test_correct_runs_are_unchanged_under_the_emulation(grid):
    for rank, results in enumerate(grid):
        for name, (same, failure, issued) in results["transparent"].items():
            assert failure is None, (rank, name, failure)
            assert issued > 0, (rank, name)  # it did emulate the run's collectives
            assert same, f"rank {rank} {name}: the emulated run differs"


def test_negative_control_planted_use_before_wait_fails(grid):
    for rank, results in enumerate(grid):
        for kind, (outcome, planted) in results["planted"].items():
            assert planted > 0, f"rank {rank}: the plant on {kind} never hit a wait"
            assert outcome != "missed", f"rank {rank}: a use-before-wait of {kind} passed"


def test_emulated_when_is_a_no_op_when_disabled():
    with emulated_when(False) as emulation:
        assert emulation is None
