"""The life of a sharded model as frameworks drive it, each case once with rf.fully_shard and once
with torch's FSDP2 in the same launch (2 Gloo ranks), against one process on the global batch:
the meta-device recipe (fully_shard, to_empty, reset_parameters), torchtitan's gradient-division
switch on torch's FSDPModule, an activation-checkpoint wrapper as the unit, a list of modules as
one unit, two forwards before one backward, and a dtype change after sharding. Every case here
trained nothing, saved a wrong checkpoint or failed when sharded parameters were plain local
pieces; each has its negative control.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Shard

import raggedfsdp as rf
from harness import error_message, full_state, run_distributed

WORLD = 2
BATCH = 4  # per rank
IMPLS: dict[str, Callable[..., Any]] = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """Blocks between an input projection and a normed output head (torchtitan's shape)."""

    def __init__(self, dim: int = 12, vocab: int = 7) -> None:
        super().__init__()
        self.embed = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor, hidden_only: bool = False) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        if hidden_only:  # the normed hidden state, for a loss that runs the output itself
            return self.norm(h)
        return self.output(self.norm(h)).pow(2).mean()

    def init_weights(self) -> None:
        """Every module's own initialisation, in module order (what construction draws)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                module.reset_parameters()


def _shard(impl: str, model: Net, *, grouped_head: bool = True) -> Net:
    """torchtitan's way: each block, the norm and output together, then the root."""
    shard = IMPLS[impl]
    for block in model.blocks:
        shard(block)
    if grouped_head:
        shard([model.norm, model.output])
    shard(model)
    return model


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH * WORLD, 5, generator=generator) for _ in range(steps)]


def _mine(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * BATCH : (rank + 1) * BATCH]


def _train(model: nn.Module, rank: int, *, steps: int = 3, twice: bool = False) -> dict:
    """AdamW steps (``twice``: two forwards, one of a flipped batch, then one backward)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in _batches(steps):
        loss = model(_mine(x, rank) if rank >= 0 else x)
        if twice:
            flipped = x.flip(0)
            loss = loss + 0.5 * model(_mine(flipped, rank) if rank >= 0 else flipped)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (
        full_state(model)
        if rank >= 0
        else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )


def _meta_recipe(impl: str, rank: int) -> dict[str, Any]:
    """FSDP2's meta-device recipe: build on meta, shard, to_empty, then each module's own
    reset_parameters() on every rank (Lightning's empty_init, torchtitan's init_weights)."""
    with torch.device("meta"):
        model = Net()
    _shard(impl, model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.init_weights()
    initial = full_state(model)
    return {"initial": initial, "trained": _train(model, rank)}


def _case_grid(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    base = Net()
    out["reference"] = _train(copy.deepcopy(base), -1)
    out["reference_base_norms"] = torch.linalg.norm(base.blocks[0].fc.weight.detach(), dim=1)
    out["reference_twice"] = _train(copy.deepcopy(base), -1, twice=True)
    torch.manual_seed(1)
    out["reference_init"] = Net().state_dict()
    for impl in IMPLS:
        res = out.setdefault(impl, {})
        res["grouped"] = _train(_shard(impl, copy.deepcopy(base)), rank)
        res["twice"] = _train(_shard(impl, copy.deepcopy(base)), rank, twice=True)
        res["meta"] = _meta_recipe(impl, rank)
        res["row_norms"] = _row_norms(_shard(impl, copy.deepcopy(base)))
        res["divide"] = _summed_gradient_norm(impl, base, rank)
        res["wrapped"] = _checkpoint_wrapped(impl, base, rank)
        double = _shard(impl, copy.deepcopy(base))
        double.to(torch.float64)
        res["float64"] = {k: v.float() for k, v in _train_double(double, rank).items()}
    out["reference_chunked"] = _chunked(copy.deepcopy(base), -1)
    out["rf"]["chunked"] = _chunked(_shard("rf", copy.deepcopy(base)), rank)
    out["rf"]["local_init"] = _local_init(rank)
    out["rf"]["interrupted"] = _interrupted(base, rank, reset=True)
    out["rf"]["not_reset"] = _interrupted(base, rank, reset=False)
    out["errors"] = _errors(base)
    return out


def _chunked_loss(model: Net, x: torch.Tensor) -> torch.Tensor:
    hidden = model(x, hidden_only=True)
    return sum(model.output(chunk).pow(2).mean() for chunk in hidden.chunk(4)) / 4


def _chunked(model: Net, rank: int) -> dict[str, torch.Tensor]:
    """The chunked-loss pattern (torchtitan's): the model's forward stops before the output
    layer, a member of the grouped unit [norm, output], which then runs once per chunk. One
    process averages the ranks' losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches(2):
        if rank >= 0:
            loss = _chunked_loss(model, _mine(x, rank))
        else:
            loss = sum(_chunked_loss(model, _mine(x, r)) for r in range(WORLD)) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank < 0:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return full_state(model)


def _row_norms(model: Net) -> torch.Tensor:
    """An op with no piece-wise form (a norm along rows of a weight cut anywhere, as weight-norm
    initialisations compute): done on the whole tensor, its result replicated."""
    with torch.no_grad():
        norms = torch.linalg.norm(model.blocks[0].fc.weight, dim=1)
    return norms.full_tensor() if isinstance(norms, DTensor) else norms


def _train_double(model: Net, rank: int) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in _batches(3):
        model(_mine(x, rank).double()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model)


def _summed_gradient_norm(impl: str, base: Net, rank: int) -> tuple[float, float]:
    """torchtitan turns the gradient division off on every torch FSDPModule (the loss is
    already normalised by a global token count): the gradient norm, divided and not (FSDP2's
    undivided reduction needs PREMUL_SUM, which Gloo lacks: divided only)."""
    norms = []
    for switch in (False, True) if impl == "rf" else (False,):
        model = _shard(impl, copy.deepcopy(base))
        if switch:
            for module in model.modules():
                if isinstance(module, TorchFSDPModule):
                    module.set_gradient_divide_factor(1.0)
        model(_mine(_batches(1)[0], rank)).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    return tuple(float(n.full_tensor()) for n in norms)  # type: ignore[return-value]


def _checkpoint_wrapped(impl: str, base: Net, rank: int) -> dict[str, Any]:
    """Activation checkpointing applied before sharding: the wrapper is the unit."""
    model = copy.deepcopy(base)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
        IMPLS[impl](model.blocks[i])
    IMPLS[impl](model)
    state = model.state_dict()
    return {
        "keys": sorted(state),
        "dtensors": all(isinstance(v, DTensor) for v in state.values()),
        "shapes": {k: tuple(v.shape) for k, v in state.items()},
        "trained": _train(model, rank),
    }


def _local_init(rank: int) -> dict[str, torch.Tensor]:
    """Negative control of the meta recipe: an initialisation of each rank's piece alone draws
    the same values on every rank, not the whole tensor's."""
    with torch.device("meta"):
        model = Net()
    _shard("rf", model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    return full_state(model)


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time (a failure half way through backward)."""

    armed = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("planted failure")
        return grad


def _interrupted(base: Net, rank: int, *, reset: bool) -> Any:
    """A backward that raises half way (after block 1's, before block 0's), then FSDP2's
    ``reset_iter_state()`` and training on: as if the failed batch had never been (``reset``);
    without the reset, the next forward's error (the negative control)."""
    model = _shard("rf", copy.deepcopy(base))
    _FailOnce.armed = True
    hook = model.blocks[0].register_forward_hook(lambda m, i, o: _FailOnce.apply(o))
    with contextlib.suppress(RuntimeError):  # the planted failure
        model(_mine(_batches(1)[0], rank)).backward()
    hook.remove()
    model.zero_grad(set_to_none=True)
    if not reset:
        return error_message(lambda: model(_mine(_batches(1)[0], rank)))
    model.reset_iter_state()
    return _train(model, rank)


def _errors(base: Net) -> dict[str, str]:
    sharded = _shard("rf", copy.deepcopy(base))
    with torch.device("meta"):
        on_meta = _shard("rf", Net())
    one_d = nn.Linear(4, 3)
    rf.fully_shard(one_d, shard_placement_fn=lambda p: Shard(-1) if p.dim() == 1 else Shard(0))
    return {
        "module_list": error_message(lambda: rf.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))),
        "deepcopy": error_message(lambda: copy.deepcopy(sharded)),
        "meta": error_message(lambda: on_meta(torch.randn(BATCH, 5))),
        "column": error_message(
            lambda: rf.fully_shard(nn.Linear(4, 3), shard_placement_fn=lambda p: Shard(1))
        ),
        "one_d": "accepted" if isinstance(one_d.bias, DTensor) else "refused",
    }


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(_case_grid, WORLD)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), rtol=tol, atol=tol, msg=key)


def test_a_list_of_modules_is_one_unit_and_trains_as_one_process(grid):
    for rank in grid:
        _close(rank["rf"]["grouped"], rank["reference"])
        _close(rank["fsdp2"]["grouped"], rank["reference"])


def test_two_forwards_then_one_backward(grid):
    for rank in grid:
        _close(rank["rf"]["twice"], rank["reference_twice"])
        _close(rank["fsdp2"]["twice"], rank["reference_twice"])


def test_meta_recipe_initialises_as_one_process_and_trains(grid):
    for rank in grid:
        for impl in IMPLS:
            assert rank[impl]["meta"]["trained"].keys() == rank["reference_init"].keys()
        # raggedfsdp draws every parameter whole: the values of one process, bit for bit
        for key, value in rank["reference_init"].items():
            assert torch.equal(rank["rf"]["meta"]["initial"][key], value), key
        # and it trains (the loss moved the parameters)
        assert any(
            not torch.equal(rank["rf"]["meta"]["trained"][k], v)
            for k, v in rank["rf"]["meta"]["initial"].items()
        )


def test_negative_control_a_piece_initialised_alone_is_not_the_whole(grid):
    local = grid[0]["rf"]["local_init"]
    assert any(not torch.equal(local[k], v) for k, v in grid[0]["reference_init"].items())


def test_torchtitan_gradient_division_switch_reaches_raggedfsdp(grid):
    for rank in grid:
        divided, summed = rank["rf"]["divide"]
        assert summed == pytest.approx(WORLD * divided, rel=1e-5)  # the switch took effect
        assert divided == pytest.approx(rank["fsdp2"]["divide"][0], rel=1e-5)


def test_checkpoint_wrapper_as_the_unit_saves_global_dtensors(grid):
    for rank in grid:
        ours, theirs = rank["rf"]["wrapped"], rank["fsdp2"]["wrapped"]
        assert ours["keys"] == theirs["keys"] == sorted(rank["reference"])
        assert ours["dtensors"] and theirs["dtensors"]
        assert ours["shapes"] == theirs["shapes"]
        _close(ours["trained"], rank["reference"])


def test_dtype_change_after_sharding_trains(grid):
    for rank in grid:
        _close(rank["rf"]["float64"], rank["fsdp2"]["float64"], tol=1e-6)
        _close(rank["rf"]["float64"], rank["reference"], tol=1e-4)


def test_bad_input_is_one_clear_error(grid):
    errors = grid[0]["errors"]
    assert "containers that do not implement forward (ModuleList)" in errors["module_list"]
    assert "FSDP does not support deepcopy" in errors["deepcopy"]
    assert "still on the meta device" in errors["meta"] and "blocks.0.fc.weight" in errors["meta"]
    assert "Shard(dim=1)" in errors["column"]
    assert errors["one_d"] == "accepted"


def test_reset_iter_state_after_an_interrupted_backward(grid):
    for rank in grid:
        _close(rank["rf"]["interrupted"], rank["reference"])
        assert "call model.reset_iter_state() first" in rank["rf"]["not_reset"]  # not silent


def test_an_op_without_a_piecewise_form_runs_on_the_whole_tensor(grid):
    base = grid[0]["reference_base_norms"]
    for rank in grid:
        for impl in IMPLS:
            torch.testing.assert_close(rank[impl]["row_norms"], base)


def test_chunked_loss_calls_a_grouped_module_on_its_own(grid):
    for rank in grid:
        _close(rank["rf"]["chunked"], rank["reference_chunked"])
