"""PyTorch Lightning's ``ModelParallelStrategy`` on 2 CPU processes (Gloo), the user's
``configure_model`` calling ``rf.fully_shard`` -- and, in the same launch, FSDP2's
``fully_shard``: the model built under ``trainer.init_module(empty_init=True)`` (Lightning then
calls ``to_empty`` and every module's ``reset_parameters()``), trained with
``gradient_clip_val``, saved with ``trainer.save_checkpoint`` (a DCP folder, and one full file
as ``save_distributed_checkpoint=False`` writes it) and resumed from each by a new
``Trainer.fit(ckpt_path=...)`` into a model built on meta again. Each run is judged against
one process training the same global batches, clipped the same way, from the run's own initial
parameters.

The silent failures of the framework-recipes issue, each with its negative control:

- ``init_module(empty_init=True)`` trained nothing: the parameters after training equal the
  reference's, which moved away from the initial ones (the control: a run that trained
  nothing would fail); raggedfsdp's initial parameters are one process's bit for bit;
- the resume failed in Lightning's ``_has_dtensor_modules`` (parameters were not DTensors): the
  resumed run continues exactly where the saved one stopped; the control: Lightning's loader
  refuses a model that is not sharded with the error raggedfsdp's used to hit.

Needs the optional extra ``raggedfsdp[frameworks]``; skipped (one line) without it.
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="the optional extra raggedfsdp[frameworks] is missing")

from harness import assert_close_dicts, run_distributed

WORLD = 2
BATCH = 4  # per rank
SAMPLES = 16
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)
CLIP = 0.05  # below the gradient norms: every step clips
LR = 1e-2
SEED = 7
IMPLS = ("rf", "fsdp2")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.output = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return (self.output(h) - y).pow(2).mean()


def _dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 5, generator=g)
    y = torch.tanh(x @ torch.randn(5, 3, generator=g))
    return list(zip(x, y, strict=True))


def _reference(initial: dict[str, torch.Tensor], batches: list[list[torch.Tensor]]) -> dict:
    """One process from ``initial`` on the global batches (every rank's batch of each step,
    as Lightning's distributed sampler dealt them), clipped as Lightning clips (torch's
    clip_grad_norm_ after backward), AdamW; the parameters after each epoch."""
    model = Net()
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms, states = [], []
    for step, (x, y) in enumerate(batches, 1):
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        if step % STEPS_PER_EPOCH == 0:
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"norms": norms, "states": states}


def _lightning_run(impl: str, root: Path, epochs: int, ckpt: Path | None) -> dict[str, Any]:
    """One ``Trainer.fit`` of ``epochs`` epochs (resumed from ``ckpt`` if given), the model
    built on meta; returns its initial and final full parameters, the gradient norms before
    clipping, and the module for the checks."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import raggedfsdp as rf

    shard = rf.fully_shard if impl == "rf" else fully_shard
    full = StateDictOptions(full_state_dict=True)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net()
            self.norms: list[float] = []
            self.batches: list[list[torch.Tensor]] = []
            self.initial: dict[str, torch.Tensor] = {}

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                shard(block, mesh=mesh)
            shard(self.model, mesh=mesh)
            torch.manual_seed(SEED)  # what Lightning's reset_parameters() then draws

        def on_fit_start(self) -> None:
            self.initial = get_model_state_dict(self.model, options=full)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            self.batches.append([t.clone() for t in batch])
            return self.model(*batch)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
            self.norms.append(float(norm.full_tensor()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_epochs=epochs,
        gradient_clip_val=CLIP,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with trainer.init_module(empty_init=True):
        lit = Lit()
    on_meta = all(p.is_meta for p in lit.parameters())
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=BATCH)
    trainer.fit(lit, loader, ckpt_path=None if ckpt is None else str(ckpt))
    dealt: list[Any] = [None] * WORLD
    torch.distributed.all_gather_object(dealt, lit.batches)
    return {
        "trainer": trainer,
        "batches": [
            [torch.cat(t) for t in zip(*step, strict=True)] for step in zip(*dealt, strict=True)
        ],
        "lit": lit,
        "built_on_meta": on_meta,
        "initial": lit.initial,
        "norms": lit.norms,
        "final": get_model_state_dict(lit.model, options=full),
        "step": trainer.global_step,
    }


def _save_and_resume(impl: str, root: Path) -> dict[str, Any]:
    """One epoch, saved as a DCP folder (the default) and as one full file (the strategy's
    ``save_distributed_checkpoint=False``); a new Trainer resumed from each for a second epoch:
    what they trained, and the one-process reference on the same batches from the same initial
    parameters."""
    from lightning.fabric.strategies.model_parallel import _has_dtensor_modules
    from torch.distributed.tensor import DTensor

    first = _lightning_run(impl, root / impl, epochs=1, ckpt=None)
    checkpoints = {"dcp": root / f"{impl}.ckpt", "full": root / f"{impl}-full.ckpt"}
    first["trainer"].save_checkpoint(checkpoints["dcp"])
    first["trainer"].strategy._save_distributed_checkpoint = False
    first["trainer"].save_checkpoint(checkpoints["full"])
    out: dict[str, Any] = {
        "built_on_meta": first["built_on_meta"],
        "checkpoint_is_dcp": (checkpoints["dcp"] / ".metadata").is_file(),
        "checkpoint_is_file": checkpoints["full"].is_file(),
        "initial": first["initial"],
        "after_first": first["final"],
        "norms_first": first["norms"],
        "reference": {},
    }
    for kind, ckpt in checkpoints.items():
        resumed = _lightning_run(impl, root / f"{impl}-{kind}", epochs=2, ckpt=ckpt)
        model = resumed["lit"].model
        out["built_on_meta"] &= resumed["built_on_meta"]
        out[kind] = {
            "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "has_dtensor_modules": _has_dtensor_modules(model),
            "steps": (first["step"], resumed["step"]),
            "after_resume": resumed["final"],
            "norms": first["norms"] + resumed["norms"],
        }
        batches = first["batches"] + resumed["batches"]
        out["reference"][kind] = _reference(first["initial"], batches)
    return out


def _cases(rank: int, world: int, root: Path) -> dict[str, Any]:
    from lightning.fabric.strategies.model_parallel import _load_checkpoint

    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0"})  # the ranks exist already
    out: dict[str, Any] = {}
    torch.manual_seed(SEED)
    out["seeded_init"] = Net().state_dict()  # what one process builds after the same seed
    for impl in IMPLS:
        # a failure is this implementation's, reported by its own tests (every rank fails alike)
        try:
            out[impl] = _save_and_resume(impl, root)
        except Exception:
            out[impl] = traceback.format_exc()
    # negative control of the resume: Lightning's loader, given a model whose parameters are not
    # DTensors (what raggedfsdp's sharded parameters were), finds no model to load into
    try:
        _load_checkpoint(root / "rf.ckpt", {"model": copy.deepcopy(Net())})
        out["plain_model_load"] = "no error"
    except ValueError as e:
        out["plain_model_load"] = str(e)
    return out


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_cases, WORLD, tmp_path_factory.mktemp("lightning"), timeout=900)


@pytest.mark.parametrize("kind", ["dcp", "full"])
@pytest.mark.parametrize("impl", IMPLS)
def test_trains_clips_saves_and_resumes_as_one_process(grid, impl, kind):
    for rank in grid:
        run = rank[impl]
        assert not isinstance(run, str), run
        assert run["checkpoint_is_dcp"] and run["checkpoint_is_file"]
        resumed, reference = run[kind], run["reference"][kind]
        assert resumed["dtensors"]
        assert resumed["steps"] == (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)
        assert resumed["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert min(reference["norms"]) > CLIP  # every step clipped
        assert_close_dicts(run["after_first"], reference["states"][0], atol=1e-6)
        assert_close_dicts(resumed["after_resume"], reference["states"][1], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_init_trains(grid, impl):
    for rank in grid:
        run = rank[impl]
        assert not isinstance(run, str), run
        assert run["built_on_meta"]
        # negative control: training moves every parameter, so a run that trained nothing
        # (parameters left at their initial values) cannot equal the reference
        trained = run["reference"]["dcp"]["states"][1]
        for key, value in run["initial"].items():
            assert (trained[key] - value).abs().max() > 1e-3, key
        assert_close_dicts(run["dcp"]["after_resume"], trained, atol=1e-6)


def test_empty_init_draws_what_one_process_draws(grid):
    for rank in grid:
        assert not isinstance(rank["rf"], str), rank["rf"]
        for key, value in rank["seeded_init"].items():
            assert torch.equal(rank["rf"]["initial"][key], value), key


def test_resume_finds_the_sharded_model(grid):
    for rank in grid:
        for impl in IMPLS:
            assert not isinstance(rank[impl], str), rank[impl]
            assert rank[impl]["dcp"]["has_dtensor_modules"], impl
            assert rank[impl]["full"]["has_dtensor_modules"], impl
        assert "Could not find a distributed model" in rank["plain_model_load"]
