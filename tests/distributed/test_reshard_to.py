"""FSDP2's ``reshard_after_forward=N`` on raggedfsdp: one Gloo launch of 4 ranks trains OddModel
with ``N = 2`` (kept sharded over pairs of ranks after forward, gathered within the pair in
backward), with FSDP2 in the same launch and against one process; ``stats()`` counts the pieces
kept and the pairs' all-gathers, and ``reshard_after_forward=True`` (the control) counts none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import raggedfsdp as rf
from harness import run_distributed
from parity_models import OddModel, make_batches
from raggedfsdp.capacity.cost import StepShape, post_forward_bytes, unit_bytes
from raggedfsdp.capacity.steptime import collective_bytes
from raggedfsdp.facts.systems import RAGGEDFSDP

WORLD, STEPS, PAIR = 4, 2, 2


def _shard(impl: str, reshard_after_forward: bool | int, set_later: bool = False) -> nn.Module:
    """OddModel, each block and the root sharded over the 4 ranks; ``set_later``: the blocks
    given ``reshard_after_forward`` by ``set_reshard_after_forward`` after ``fully_shard``."""
    torch.manual_seed(0)
    model = OddModel()
    fully_shard = torch_fully_shard if impl == "torch" else rf.fully_shard
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True if set_later else reshard_after_forward)
        if set_later:
            block.set_reshard_after_forward(reshard_after_forward)
    return fully_shard(model)


def _train(
    model: nn.Module, rank: int | None, record: dict[str, Any] | None = None
) -> torch.Tensor:
    """Parameters after ``STEPS`` SGD steps (linear in the gradient: round-off is not
    amplified as AdamW's first steps amplify it at 4 ranks) on this rank's quarter of the
    global batch (``None``: all of it, one process); ``record``: raggedfsdp's counters after
    each forward and each step, and after the steps."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for idx, targets in make_batches(STEPS, 2 * WORLD):
        mine = slice(None) if rank is None else slice(rank * 2, rank * 2 + 2)
        loss = model(idx[mine], targets[mine])
        if record is not None:
            record.setdefault("forwards", []).append(model.stats())
            record["after_forward"] = record["forwards"][0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        if record is not None:
            record.setdefault("steps", []).append(model.stats())
    if record is not None:
        record["after_steps"] = model.stats()
        record["block_0_buffer"] = model.blocks[0].shard_plans()[0].total_numel
    options = StateDictOptions(full_state_dict=rank is not None)
    full = get_model_state_dict(model, options=options)
    return torch.cat([v.reshape(-1) for v in full.values()])


def _run(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict[str, Any] = {"reference": _train(OddModel(), None)}
    out["torch"] = _train(_shard("torch", PAIR), rank)
    for name, value, later in (
        ("pair", PAIR, False),
        ("set_pair", PAIR, True),
        ("true", True, False),
    ):
        record: dict[str, Any] = {}
        out[name] = _train(_shard("rf", value, later), rank, record)
        out[f"{name}_stats"] = record
    errors = {}
    for value in (3, 0, 5):
        try:
            rf.fully_shard(nn.Linear(4, 4), reshard_after_forward=value)
        except ValueError as error:
            errors[value] = str(error)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD)


@pytest.mark.parametrize("case", ["pair", "set_pair", "true"])
def test_trains_as_fsdp2_and_one_process(results, case):
    for rank in results:
        torch.testing.assert_close(rank[case], rank["torch"])
        torch.testing.assert_close(rank[case], rank["reference"])


def test_pieces_kept_after_forward_and_gathered_within_pairs(results):
    """The blocks reshard after forward to pairs (block 1 only in the first forward: it runs
    forward last and keeps its parameters from then on, the root always): after the first
    forward each holds half of its bucket's gathered buffer (4 ranks' shards, fp32), and
    backward all-gathers it within the pair once, each rank sending its half; nothing is held
    after the steps. The control: resharding
    to all 4 ranks keeps nothing and gathers within no pair."""
    for rank in results:
        for case in ("pair", "set_pair"):
            stats = rank[f"{case}_stats"]
            half = stats["block_0_buffer"] * 4 // PAIR
            # the first forward records the order: both blocks reshard in it
            assert stats["after_forward"]["post_forward_bytes"] == 2 * half
            assert stats["after_steps"]["post_forward_bytes"] == 0
            assert stats["after_steps"]["post_forward_all_gather_calls"] == STEPS + 1
            assert stats["after_steps"]["post_forward_all_gather_bytes"] == (STEPS + 1) * half
        control = rank["true_stats"]
        assert control["after_forward"]["post_forward_bytes"] == 0
        assert control["after_steps"]["post_forward_all_gather_calls"] == 0
        kept = rank["pair_stats"]["after_forward"]["peak_unsharded_bytes"]
        assert kept - control["after_forward"]["peak_unsharded_bytes"] == 2 * half


def test_capacity_model_predicts_the_pieces_and_their_all_gathers(results):
    """The capacity model (``StepShape(reshard_after_forward=2)`` over the plans ``fully_shard``
    makes at W = 4) against a steady step's counters (the second: the first forward also
    reshards the last block, recording the order): after forward the pieces block 0 keeps,
    and backward's all-gather of them within the pair, calls and bytes; the whole step's
    all-gather bytes too (each unit's shard in forward, the piece in backward). The control:
    at ``N = 4`` (resharded in full) the model keeps and gathers no piece, as the run counts."""
    model = OddModel()
    units = unit_bytes(rf.StructAwarePlanner().plan_model(model, WORLD, dtype=torch.float32))
    pair = StepShape(batch=2, seq_len=6, gloo=True, reshard_after_forward=PAIR)
    whole = dataclasses.replace(pair, reshard_after_forward=WORLD)
    kept = post_forward_bytes(units, pair, WORLD, RAGGEDFSDP)
    predicted, control = collective_bytes(units, pair, WORLD), collective_bytes(units, whole, WORLD)
    assert kept[0] > 0 and control.post_forward_all_gather_bytes == 0
    assert sum(post_forward_bytes(units, whole, WORLD, RAGGEDFSDP)) == 0
    for rank in results:
        forward, (first, second) = rank["pair_stats"]["forwards"][1], rank["pair_stats"]["steps"]
        assert forward["post_forward_bytes"] == sum(kept)
        for key in ("post_forward_all_gather_calls", "post_forward_all_gather_bytes"):
            assert second[key] - first[key] == getattr(predicted, key), key
        assert second["all_gather_bytes"] - first["all_gather_bytes"] == predicted.all_gather_bytes
        assert predicted.all_gather_bytes != control.all_gather_bytes


def test_an_int_that_is_no_factor_of_the_shard_group_is_refused_as_fsdp2_does(results):
    for rank in results:
        for value, message in rank["errors"].items():
            assert f"it should be a factor of {WORLD}, not {value}" in message
