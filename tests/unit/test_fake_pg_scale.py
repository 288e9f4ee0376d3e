"""The NCCL branch at W = 8, 64 and 1024 in this one process: torch's fake process group
(``fake_ranks.py``) plays a few ranks of each world, one after another, training a small GPT
two steps; the recorder (``collective_wrap.py``) keeps what each issued in the second step.

Asserted per world size and configuration (plain, bf16 mixed precision, compressed, HSDP):
every member of a group issues the same sequence of collectives (NCCL matches by order); each
bucket's messages have the size its plan gives, the same on every rank; plans place buffers
and size shards on 16 bytes; and a step issues one all-gather per bucket, one reduce-scatter
(or all-to-all, compressed) per trainable bucket, and under HSDP one all-reduce per trainable
bucket (``reshard_after_forward=False``: nothing is gathered twice), and one all-reduce (two
under HSDP) of which parameters any rank used (``runtime/_usage.py``).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import raggedfsdp as rf
from collective_wrap import Record, first_difference, recording
from fake_ranks import fake_world
from raggedfsdp.models import GPT
from raggedfsdp.models.gpt import GPTConfig
from raggedfsdp.planner import ShardPlan, quant_block

pytestmark = pytest.mark.slow

WORLDS = (8, 64, 1024)
CONFIG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=32)
POLICY = rf.RaggedShard(block_size=None)
BF16 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
INT8 = rf.CommCompression(all_gather=torch.int8, reduce_scatter=torch.int8)
#: name -> (mixed precision, compression, HSDP)
VARIANTS = {
    "plain": (None, None, False),
    "bf16": (BF16, None, False),
    "compressed": (None, INT8, False),
    "hsdp": (None, None, True),
}
GATHERS = {"all_gather"}
REDUCES = {"reduce_scatter", "all_to_all"}


def _ranks(world: int) -> tuple[int, ...]:
    """The ranks whose views are compared: both ends, and both sides of the middle (under
    HSDP the first and last of each half)."""
    return (0, 1, world // 2 - 1, world // 2, world - 1)


@dataclass(frozen=True)
class View:
    """What one rank issued in its second step, and the plans of its buckets."""

    records: list[Record]
    plans: list[ShardPlan]
    comm_dtype: torch.dtype


def _view(rank: int, world: int, variant: str) -> View:
    mp, compression, hsdp = VARIANTS[variant]
    with fake_world(rank, world):
        mesh = None
        if hsdp:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = GPT(CONFIG)
        rf.FSDPBackend(
            model,
            shard_policy=POLICY,
            mesh=mesh,
            mp_policy=mp,
            compression=compression,
            reshard_after_forward=False,
        )
        idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
        with recording() as recorder:
            recorder.on = False  # the first step also checks the plans and records the order
            model(idx, idx).backward()
            recorder.on = True
            model.zero_grad(set_to_none=True)
            model(idx, idx).backward()
        dtype = torch.float32 if mp is None else mp.param_dtype
        return View(recorder.take(), model.shard_plans(), dtype)


@functools.cache
def _views(world: int, variant: str) -> dict[int, View]:
    """Every compared rank's view (made once per module run: the tests read them)."""
    return {rank: _view(rank, world, variant) for rank in _ranks(world)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world", WORLDS)
def test_members_issue_the_same_sequence(world, variant):
    views = _views(world, variant)
    assert first_difference({r: v.records for r, v in views.items()}) is None
    for view in views.values():
        assert not {r.kind for r in view.records} & {"send", "recv"}, "a point-to-point call"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("world", WORLDS)
def test_collectives_per_step_and_message_sizes(world, variant):
    _, compression, hsdp = VARIANTS[variant]
    for rank, view in _views(world, variant).items():
        kinds = Counter(r.kind for r in view.records)
        buckets = len(view.plans)  # every GPT parameter trains: every bucket reduces
        expected = {"all_gather": buckets}
        expected["all_to_all" if compression else "reduce_scatter"] = buckets
        # and which parameters any rank used: one all-reduce, over both dims under HSDP
        expected["all_reduce"] = buckets + 2 if hsdp else 1
        assert kinds == expected, (rank, kinds)
        gathers = [r for r in view.records if r.kind in GATHERS]
        reduces = [r for r in view.records if r.kind in REDUCES]
        shards = world // 2 if hsdp else world
        if compression is None:
            sizes = Counter(p.shard_numel for p in view.plans)
            assert Counter(r.input_numel for r in gathers) == sizes
            assert Counter(r.output_numel for r in reduces) == sizes
            assert all(r.output_numel == shards * r.input_numel for r in gathers)
            assert all(r.input_numel == shards * r.output_numel for r in reduces)
        else:
            _check_messages(view, gathers, reduces, world)


def _check_messages(view: View, gathers: list[Record], reduces: list[Record], world: int):
    """Compressed: each bucket's message holds the codes of a shard and the scales of the rank
    with the most quantization blocks (computed from the plan over all ``world`` ranks), in
    one size for every rank and both directions."""
    needs = Counter(_largest_message_need(plan) for plan in view.plans)
    got = sorted(r.input_numel for r in gathers)
    assert sorted(r.input_numel for r in reduces) == sorted(g * world for g in got)
    assert all(r.output_numel == r.input_numel for r in reduces)
    assert all(r.output_numel == world * r.input_numel for r in gathers)
    for message, need in zip(got, sorted(needs.elements()), strict=True):
        # padding only: codes and scales each start aligned (4 bytes today, 16 once issue 23's
        # part B lands)
        assert need <= message < need + 32, (message, need)


def _largest_message_need(plan: ShardPlan) -> int:
    """Bytes of the largest rank's codes and fp32 scales, from the plan alone."""
    blocks = [
        sum(
            quant_block(e.name, e.shape, POLICY).num_blocks(end - start)
            for e in plan.entries.values()
            for start, end in [plan.local_range(e.name, rank)]
        )
        for rank in range(plan.world_size)
    ]
    return plan.shard_numel + 4 * max(blocks)


@pytest.mark.parametrize("variant", ["plain", "bf16", "hsdp"])
@pytest.mark.parametrize("world", WORLDS)
def test_buffers_and_messages_are_16_byte_aligned(world, variant):
    for view in _views(world, variant).values():
        itemsize = view.comm_dtype.itemsize
        for plan in view.plans:
            assert plan.shard_numel * itemsize % 16 == 0, plan.name
            assert all(e.offset * itemsize % 16 == 0 for e in plan.entries.values()), plan.name
        for record in view.records:
            assert record.misalignment == (0,) * len(record.misalignment), record
            assert all(n % 16 == 0 for n in record.nbytes), record


@pytest.mark.parametrize("world", WORLDS)
def test_compressed_messages_are_16_byte_aligned(world):
    """Each message, and the fp32 scales inside it, start 16-byte aligned (the codes are
    padded to 16 bytes before the scales): NCCL's fast path wants 16."""
    for view in _views(world, "compressed").values():
        for record in view.records:
            assert record.misalignment == (0,) * len(record.misalignment), record
            assert all(n % 16 == 0 for n in record.nbytes), record
