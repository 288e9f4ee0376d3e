"""The runtime's state machines: an impossible transition is an error naming rank, unit and
state, not a wrong collective later."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import raggedfsdp as rf
from harness import run_distributed
from raggedfsdp.runtime._hooks import state_of
from raggedfsdp.runtime._state_machine import RootPhase, TrainingState, check_state


def test_check_state_names_rank_unit_and_states() -> None:
    check_state(TrainingState.IDLE, (TrainingState.IDLE, TrainingState.FORWARD), unit="u")
    with pytest.raises(RuntimeError) as err:
        check_state(TrainingState.IDLE, TrainingState.FORWARD, unit="blocks.0")
    assert str(err.value) == (
        "raggedfsdp: rank 0: unit 'blocks.0' is in state IDLE, expected FORWARD"
    )


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _transitions(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = rf.FSDPBackend(_Net())
    block = state_of(model.blocks[1])
    root = state_of(model)
    assert block is not None and root is not None
    phases = [root.lazy_init().phase]
    model(torch.randn(4, 8)).backward()
    phases.append(root.ctx.phase)
    states = (block.group.training_state, block.group.sharded_state)
    try:
        block.group.post_forward(reshard=True)  # no forward is running
    except RuntimeError as err:
        message = str(err)
    return {"phases": phases, "states": states, "message": message}


def test_root_phases_and_a_refused_transition() -> None:
    results = run_distributed(_transitions, 2)
    for rank, result in enumerate(results):
        assert result["phases"] == [RootPhase.FIRST_FORWARD, RootPhase.READY]
        assert [s.name for s in result["states"]] == ["IDLE", "SHARDED"]
        assert result["message"] == (
            f"raggedfsdp: rank {rank}: unit 'blocks.1' is in state IDLE, expected FORWARD"
        )
