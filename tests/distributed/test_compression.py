"""Compressed communication on real Gloo groups, one launch of 4 ranks running every case at each
world size W = 1..4, as if launched on W ranks (harness.run_world_grid; the cases are in
``compression_gather.py``, ``compression_reduce.py`` and ``compression_everywhere.py``): the
parameters forward sees equal the single-process
quantize-dequantize bit for bit, codes and scales do not depend on W, the reduce-scatter is
within the quantizer's bound per element and exact on representable blocks, the bytes on the wire
are exactly codes plus scales, error feedback drives the accumulated error down, and everything
works under HSDP, no_sync, bf16, meta init and AdamW8bit, with bad input refused. Cases named
``native`` run NCCL's calls on Gloo (``gloo_point_to_point=False``) under its asynchrony emulated
(``collective_wrap``)."""

from __future__ import annotations

import pytest
import torch

from compression_everywhere import everywhere
from compression_gather import gather_grid, quant_dequant
from compression_reduce import reduce_grid
from harness import world_grid_fixture
from raggedfsdp.planner import QuantBlock

WORLDS = (1, 2, 3, 4)


def _all_cases(rank: int, world: int, group: None = None) -> dict:
    out = {"gather": gather_grid(rank, world), "reduce": reduce_grid(rank, world)}
    if world == 4:  # HSDP needs a 2 x 2 mesh
        out["everywhere"] = everywhere(rank, world)
    return out


grid = world_grid_fixture(_all_cases, WORLDS, as_launches=True, timeout=600)


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_equals_single_process_quantize_dequantize(grid, world):
    for rank, results in enumerate(grid[world]):
        for case, (failures, _) in results["gather"].items():
            assert failures == [], f"W={world} rank {rank} {case}: {failures}"


def test_codes_and_scales_do_not_depend_on_world_size(grid):
    def whole(world, case):
        pieces: dict[str, list] = {}
        for results in grid[world]:  # rank order
            for name, piece in results["gather"][case][1].items():
                pieces.setdefault(name, []).append(piece)
        return {
            n: (b"".join(c for c, _ in ps), torch.cat([s for _, s in ps]))
            for n, ps in pieces.items()
        }

    for case in grid[1][0]["gather"]:
        one = whole(1, case)
        for world in WORLDS[1:]:
            other = whole(world, case)
            assert one.keys() == other.keys()
            for name in one:
                assert one[name][0] == other[name][0], (case, world, name)
                assert torch.equal(one[name][1], other[name][1]), (case, world, name)


def test_negative_control_flat_groups_cut_across_ranks_differ():
    """ZeRO++ / torchao style: the flattened tensor cut evenly over W ranks, each quantizing
    its chunk in runs from where it starts: the numbers change with W."""
    x = torch.randn(37, 24)
    run = QuantBlock(1, 256, 0)

    def flat_groups(world: int) -> torch.Tensor:
        chunks = x.reshape(-1).tensor_split(world)
        return torch.cat([quant_dequant(c, run, torch.int8)[0] for c in chunks])

    assert torch.equal(flat_groups(1), quant_dequant(x, run, torch.int8)[0].reshape(-1))
    for world in (2, 3, 4):
        assert not torch.equal(flat_groups(world), flat_groups(1))


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_bound_exactness_and_bytes(grid, world):
    for rank, results in enumerate(grid[world]):
        for case, failures in results["reduce"].items():
            if case == "error_feedback":
                # An error that grows with the steps, against one bounded by a single step's.
                assert failures["True"] < failures["False"] / 4, failures
                continue
            assert failures == [], f"W={world} rank {rank} {case}: {failures}"


def test_compression_everywhere(grid):
    for rank, results in enumerate(grid[4]):
        result = results["everywhere"]
        training = result["training"]
        names = ("flat", "no_sync", "bf16", "error_feedback", "adamw8bit")
        for name in (*names, "flat-native", "no_sync-native"):
            close, losses, plain, _ = training[name]
            assert close, f"rank {rank} {name}: losses {losses} vs uncompressed {plain}"
        # no_sync: only the reduce that happens is compressed (one per bucket per step).
        assert training["no_sync"][3] == training["flat"][3]
        assert training["no_sync-native"][3] == training["flat-native"][3] == training["flat"][3]
        for name in ("hsdp", "hsdp-native"):
            close, all_reduce_bytes, full_precision = training[name]
            assert close and all_reduce_bytes == full_precision, name
        assert training["hsdp_forward"] == [] and result["meta"] == []
        bad = result["bad"]
        assert "'count'" in bad["non_floating"] and "floating-point" in bad["non_floating"]
        assert "StructAwarePlanner(..., compression=...)" in bad["planner"]
        assert "block_size 8 does not divide the policy's tile 4" in bad["tile"]
        assert "'blocks.0.fc1.weight' has a non-finite value" in bad["non_finite"], bad
    # HSDP: rank 3's NaN gradient; its replica group names it, the other sees it after the
    # all-reduce over the replicas; every rank raises, then all complete the next collective.
    messages = [results["everywhere"]["hsdp_non_finite"] for results in grid[4]]
    for message, _ in messages[2:]:
        assert "parameter 'a' on rank 3 has a non-finite value" in message, messages
    for message, _ in messages[:2]:
        assert "through the all-reduce over the replicas (HSDP)" in message, messages
    assert [after for _, after in messages] == [4.0] * 4
