"""``reshard_after_forward=N`` in the capacity model, pure: its bounds against the plain model and
the arithmetic of the pieces; the runtime's counters are held to it by
tests/distributed/test_reshard_to.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import raggedfsdp as rf
from raggedfsdp.capacity import CapacityOptions, hardware
from raggedfsdp.capacity.cost import StepShape, memory_breakdown, post_forward_bytes, unit_bytes
from raggedfsdp.capacity.shapes import model_shape
from raggedfsdp.capacity.steptime import collective_bytes, step_time
from raggedfsdp.capacity.wire import CompressionSpec
from raggedfsdp.facts.systems import SYSTEMS
from raggedfsdp.models import GPT, GPT_CONFIGS

W = 16


@pytest.fixture(scope="module")
def gpt():
    module = GPT(GPT_CONFIGS["gpt-small"], device="meta")
    plans = rf.StructAwarePlanner().plan_model(module, W, dtype=torch.bfloat16)
    return model_shape(module), unit_bytes(plans)


def _step(n: int | None) -> StepShape:
    return StepShape(batch=1, seq_len=1024, param_dtype=torch.bfloat16, reshard_after_forward=n)


@pytest.mark.parametrize("system", SYSTEMS, ids=lambda s: s.name)
def test_whole_group_is_the_default_and_one_never_gathers_again(gpt, system):
    shape, units = gpt
    hw = hardware("h100")
    plain = collective_bytes(units, _step(None), W, system)
    assert collective_bytes(units, _step(W), W, system) == plain
    assert sum(post_forward_bytes(units, _step(W), W, system)) == 0
    never = collective_bytes(units, _step(1), W, system)
    regathered = len(system.regathered(len(units) - 1))
    assert never.all_gather_calls == plain.all_gather_calls - regathered
    # each block kept whole: its gathered buffer, held from forward
    blocks = [u for i, u in enumerate(units) if i in set(system.regathered(len(units) - 1))]
    whole = sum(W * u.shard(system) * 2 for u in blocks)
    assert sum(post_forward_bytes(units, _step(1), W, system)) == whole
    times = [
        step_time(shape, units, _step(n), hw, W, optimizer_bytes=0, system=system)
        for n in (None, W)
    ]
    assert times[0] == times[1]
    # N equal to the group is plain resharding under compression too (the pieces would not be)
    spec = CompressionSpec.parse("int8", None, False)
    packed = [dataclasses.replace(u, messages=tuple(s + 4 for s in u.shards)) for u in units]
    compressed = [dataclasses.replace(_step(n), compression=spec) for n in (None, W)]
    got = [collective_bytes(packed, c, W, system) for c in compressed]
    assert got[0] == got[1]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pieces_are_one_nth_of_the_buffer_and_gathered_within_n(gpt, n):
    shape, units = gpt
    system = SYSTEMS[0]
    step = _step(n)
    again = system.regathered(len(units) - 1)
    kept = post_forward_bytes(units, step, W, system)
    for i, unit in enumerate(units):
        want = W * unit.shard_numel * 2 // n if i in again else 0
        assert kept[i] == want
    got = collective_bytes(units, step, W, system)
    plain = collective_bytes(units, _step(None), W, system)
    assert got.post_forward_all_gather_bytes == sum(kept)
    assert got.all_gather_bytes - plain.all_gather_bytes == sum(kept) - sum(
        units[i].shard_numel * 2 for i in again
    )
    # each rank sends its piece to the n - 1 others instead of its shard to the W - 1
    pieces = sum(kept[i] * (n - 1) - units[i].shard_numel * 2 * (W - 1) for i in again)
    assert got.wire_bytes - plain.wire_bytes == pieces
    memory = memory_breakdown(shape, units, step, 0, world_size=W)
    base = memory_breakdown(shape, units, _step(None), 0, world_size=W)
    assert memory.unsharded - base.unsharded == memory.post_forward > 0


def test_bad_degrees_are_refused_naming_them(gpt):
    _, units = gpt
    with pytest.raises(ValueError, match="reshard_after_forward=3 is not a factor of the 16"):
        collective_bytes(units, _step(3), W)
    with pytest.raises(ValueError, match="integer >= 1"):
        _step(0)
    with pytest.raises(ValueError, match="use tp=1, ep=1"):
        CapacityOptions(batch=1, seq_len=8, tp=2, reshard_after_forward=2)
