"""raggedfsdp as a drop-in for FSDP2: the same script (tests/support/fsdp2_script.py) run with
``torch.distributed.fsdp.fully_shard`` and with ``rf.fully_shard`` in one launch gives the same
norms from torch's ``clip_grad_norm_``, the same full model and optimizer state through
``torch.distributed.checkpoint.state_dict``, and DCP checkpoints that load into either, at W=2
and resharded to W=3, and train on to the same parameters. One launch of 3 ranks: the script at
W=2, then at W=3, each as if launched on W ranks (harness.run_world_grid, ``as_launches``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import fsdp2_script as script
from harness import run_world_grid

RTOL, ATOL = 1e-5, 1e-6


def _cases(root: str, rank: int, world: int, group: None) -> dict:
    """At W=2 train and save, then load both checkpoints; at W=3 load them resharded."""
    out = {"saved": script.train_and_save(rank, world, root)} if world == 2 else {}
    out["loaded"] = script.load_and_continue(rank, world, root, 2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    grid = run_world_grid(functools.partial(_cases, root), [2, 3], as_launches=True, timeout=600)
    saved = [result["saved"] for result in grid[2]]
    loaded = {w: [result["loaded"] for result in grid[w]] for w in (2, 3)}
    return saved, loaded


def _assert_state_close(got: dict, want: dict, exact: bool = False) -> None:
    for part in ("model", "optim"):
        assert got[part].keys() == want[part].keys(), part
    pairs = [(k, got["model"][k], want["model"][k]) for k in want["model"]]
    pairs += [
        (f"{k}.{n}", got["optim"][k][n], v) for k, s in want["optim"].items() for n, v in s.items()
    ]
    for name, a, b in pairs:
        if exact:
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), name
        else:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)


def test_clip_grad_norm_is_global_and_matches_fsdp2(runs):
    saved, _ = runs
    for rank in saved:
        torch.testing.assert_close(rank["rf"]["norms"], rank["torch"]["norms"], rtol=RTOL, atol=0)
    assert saved[0]["rf"]["norms"] == saved[1]["rf"]["norms"]  # every rank clips alike
    assert min(saved[0]["rf"]["norms"]) > 0.5  # the clip was active


def test_full_state_dict_matches_fsdp2_on_every_rank(runs):
    saved, _ = runs
    for rank in saved:
        _assert_state_close(rank["rf"]["full"], rank["torch"]["full"])
        assert rank["rf"]["full"]["optim"]["emb.weight"]["exp_avg"].shape == (37, 24)


def test_full_state_dict_cpu_offload_only_on_rank_0(runs):
    saved, _ = runs
    for impl in script.IMPLS:
        assert saved[0][impl]["rank0_keys"][0] > 0 and saved[0][impl]["rank0_keys"][1] > 0
        assert saved[1][impl]["rank0_keys"] == (0, 0), impl


@pytest.mark.parametrize("path", ["round_trip", "broadcast"])
def test_full_state_dict_round_trips_exactly(runs, path):
    """Full state set back on every rank, or from rank 0 only (broadcast_from_rank0)."""
    saved, _ = runs
    for rank in saved:
        for impl in script.IMPLS:
            _assert_state_close(rank[impl][path], rank[impl]["full"], exact=True)


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_checkpoints_load_into_either_and_reshard(runs, world):
    saved, loaded = runs
    for rank in loaded[world]:
        for pair, result in rank.items():
            source = pair.split("->")[0]
            _assert_state_close(result["loaded"], saved[0][source]["full"], exact=True)
            assert result["loaded"]["lr"] == saved[0][source]["full"]["lr"]
        # One more step from the same state: the two implementations agree.
        for source in script.IMPLS:
            ours, theirs = rank[f"{source}->rf"]["stepped"], rank[f"{source}->torch"]["stepped"]
            _assert_state_close(ours, theirs)
