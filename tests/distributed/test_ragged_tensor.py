"""RaggedTensor, the DTensor of a ragged shard: what it holds and allows, what DCP writes from
it (the same as torch's former ShardedTensor wrote, and comparable to FSDP2's and one process's
checkpoints), and that the package no longer uses the deprecated ShardedTensor."""

from __future__ import annotations

import dataclasses
import filecmp
import functools
import io
import tempfile
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import raggedfsdp as rf
from harness import error_message, run_distributed
from parity_models import OddModel
from raggedfsdp.tensor import RaggedTensor, local_flat

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "raggedfsdp"
WORLD = 3
# What torch says when a ShardedTensor is made (its deprecation warning).
DEPRECATED = ("ShardedTensor", "Please use DTensor instead")


def test_package_does_not_use_torch_sharded_tensor() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "distributed._shard" in line
    ]
    assert offenders == []


@pytest.fixture
def rank_1_of_3():
    """A fake process group (no peers, collectives do nothing): rank 1 of 3, its 1-D mesh."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=WORLD)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()


def _piece(mesh: DeviceMesh) -> tuple[rf.ShardLayout, torch.Tensor, torch.Tensor, RaggedTensor]:
    """A [5, 6] tensor over 3 ranks; rank 1 holds elements [8, 23): three rectangles."""
    layout = rf.ShardLayout(torch.Size([5, 6]), 1, ((0, 8), (8, 23), (23, 30)))
    full = torch.arange(30.0).view(5, 6)
    piece = layout.to_local(full, 1).reshape(-1).clone()
    return layout, full, piece, RaggedTensor.from_piece(piece, layout, mesh)


def test_a_dtensor_placed_by_its_layout(rank_1_of_3) -> None:
    layout, full, piece, value = _piece(rank_1_of_3)
    assert isinstance(value, DTensor) and isinstance(value, RaggedTensor)
    assert (value.shape, value.dtype) == (full.shape, full.dtype)
    assert value.placements == (rf.RaggedShardPlacement(layout),)
    assert value.device_mesh is rank_1_of_3
    assert value.to_local().data_ptr() == piece.data_ptr()  # no copy
    assert rf.layout_of(value) == layout and rf.shard_info(value).rank == 1
    assert repr(value).startswith("RaggedTensor(local_tensor=")
    with pytest.raises(ValueError, match="has 15 elements, got 14"):
        RaggedTensor.from_piece(piece[:14], layout, rank_1_of_3)


def test_rectangles_are_views_of_the_piece(rank_1_of_3) -> None:
    layout, full, piece, value = _piece(rank_1_of_3)
    assert local_flat(value).data_ptr() == piece.data_ptr()
    chunks = value.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == layout.boxes(1)
    for chunk in chunks:
        view = value.__get_tensor_shard__(MetadataIndex("w", chunk.offsets))
        where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        assert torch.equal(view, full[where])
        assert piece.data_ptr() <= view.data_ptr() < piece.data_ptr() + 4 * piece.numel()
    items = value.__create_write_items__("w", value)
    assert [item.tensor_data.chunk for item in items] == chunks
    for item in items:
        assert item.tensor_data.size == full.shape
        # The whole tensor's, as DCP records a plain one (torch >= 2.15 adds its strides).
        assert item.tensor_data.properties == TensorProperties.create_from_tensor(full)
    with pytest.raises(ValueError, match="no rectangle"):
        value.__get_tensor_shard__(MetadataIndex("w", torch.Size([0, 0])))


def test_ops_on_the_piece_keep_the_placement_and_others_are_refused(rank_1_of_3) -> None:
    _, full, piece, value = _piece(rank_1_of_3)
    detached = value.detach()
    assert isinstance(detached, RaggedTensor)
    assert local_flat(detached).data_ptr() == piece.data_ptr()
    assert value.to("cpu") is value  # nothing to do: DSD's cpu_offload on a CPU value
    wider = value.to(torch.float64)
    assert isinstance(wider, RaggedTensor) and torch.equal(local_flat(wider), piece.double())
    assert wider.placements == value.placements and wider.dtype == torch.float64
    copy = value.clone()
    assert torch.equal(local_flat(copy), piece) and local_flat(copy).data_ptr() != piece.data_ptr()
    for result in (value * 2 + 1, torch.zeros_like(value), torch._foreach_mul([value], 2.0)[0]):
        assert isinstance(result, RaggedTensor) and result.placements == value.placements
    assert torch.equal(local_flat(value * 2 + 1), piece * 2 + 1)
    target = torch.zeros_like(value)
    target.copy_(full)  # a whole tensor: this rank's piece of it
    assert torch.equal(local_flat(target), piece)
    for refused in (lambda: value.t(), lambda: value.view(6, 5), lambda: value[0]):
        with pytest.raises(NotImplementedError, match=r"raggedfsdp: aten\.\w+"):
            refused()  # views: a write through one could not reach the shard
    with pytest.raises(ValueError, match="plain tensor of shape"):
        value + torch.ones(6)  # a piece cannot broadcast against part of the whole
    with pytest.raises(NotImplementedError, match="only Replicate"):
        value.redistribute(placements=[Shard(0)])


def test_copies_and_pickles_as_its_piece_and_place(rank_1_of_3) -> None:
    layout, _, piece, value = _piece(rank_1_of_3)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    for copy in (deepcopy(value), torch.load(buffer, weights_only=False)):
        assert isinstance(copy, RaggedTensor)
        assert copy.shard_layout == layout and copy.shard_rank == 1
        assert torch.equal(local_flat(copy), piece)
        assert local_flat(copy).data_ptr() != piece.data_ptr()


def _rf_model(seed: int, block_size: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = OddModel()
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=block_size))
    return model


def _as_sharded_tensor(value: RaggedTensor) -> Any:
    """The same rectangles as torch's deprecated ShardedTensor (how raggedfsdp saved before)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
    )
    from torch.distributed._shard.sharded_tensor.metadata import (
        TensorProperties as ShardedProperties,
    )

    layout, views = value.shard_layout, iter(view for _, view in value._rectangles())
    everyone, mine = [], []
    for rank in range(layout.world_size):
        for offsets, sizes in layout.boxes(rank):
            everyone.append(ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/cpu"))
            if rank == value.shard_rank:
                mine.append(Shard(next(views), everyone[-1]))
    properties = ShardedProperties(dtype=value.dtype, requires_grad=False)
    metadata = ShardedTensorMetadata(everyone, value.shape, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, metadata)


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if any(d in str(w.message) for d in DEPRECATED)]


def _save_and_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Saves the same model as raggedfsdp, as ShardedTensors and as FSDP2; loads raggedfsdp's
    into another plan and reads it through DSD, recording torch's deprecation warnings; and the
    errors of loading a full tensor of the wrong shape, and RaggedTensors of another plan."""
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _rf_model(1, None)
        dcp.save(model.state_dict(), checkpoint_id=f"{path}/rf")
        other = _rf_model(2, "whole")
        state = other.state_dict()
        dcp.load(state, checkpoint_id=f"{path}/rf")
        other.load_state_dict(state)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(other, options=options)
        offloaded = get_model_state_dict(other, options=StateDictOptions(cpu_offload=True))
        sharded = all(isinstance(v, RaggedTensor) for v in offloaded.values())
    with warnings.catch_warnings(record=True) as control:
        warnings.simplefilter("always")
        state = model.state_dict()
        state = {
            k: _as_sharded_tensor(v) if isinstance(v, RaggedTensor) else v for k, v in state.items()
        }
        dcp.save(state, checkpoint_id=f"{path}/sharded_tensor")
        dcp.load(state, checkpoint_id=f"{path}/sharded_tensor")  # warns (as raggedfsdp did)
    torch.manual_seed(1)
    fsdp2 = OddModel()
    for block in fsdp2.blocks:
        torch_fully_shard(block)
    torch_fully_shard(fsdp2)
    dcp.save(fsdp2.state_dict(), checkpoint_id=f"{path}/fsdp2")
    wrong_shape = {**model.state_dict(), "emb.weight": torch.zeros(3, 3)}
    errors = {
        "shape": error_message(lambda: model.load_state_dict(wrong_shape)),
        **_optimizer_plan_errors(model, other),
    }
    # Another plan's sharded values loaded without DCP: copy_ reshards them (a collective, as
    # every rank loads), as a DTensor of another placement would be.
    third = _rf_model(3, 4)
    third.load_state_dict(other.state_dict())
    return {
        "full": full,
        "resharded": rf.full_state_dict(third),
        "sharded": sharded,
        "warnings": _deprecations(caught),
        "control": _deprecations(control),
        "errors": errors,
    }


def _optimizer_plan_errors(model: torch.nn.Module, other: torch.nn.Module) -> dict[str, str]:
    """Optimizer state of another plan, handed over without DCP (which would reshard it):
    through raggedfsdp's functions (torch's AdamW), through DSD into raggedfsdp's Muon (which
    checks what it loads), and through DSD into torch's AdamW, which takes it as it is (as over
    FSDP2): its next step then refuses to mix the two layouts."""
    errors = {}
    for kind in ("optimizer", "dsd_optimizer", "dsd_torch_optimizer_step"):
        ours, theirs = (_optimizer(kind, m) for m in (model, other))
        if kind == "optimizer":
            state = rf.optim_state_dict(other, theirs)
            load = functools.partial(rf.load_optim_state_dict, model, ours, state)
        else:
            state = get_optimizer_state_dict(other, theirs)
            load = functools.partial(set_optimizer_state_dict, model, ours, state)
        errors[kind] = error_message(load)
        if kind == "dsd_torch_optimizer_step":
            assert errors[kind] == "no error"
            for p in model.parameters():
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            errors[kind] = error_message(ours.step)
            ours.zero_grad()
    return errors


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Torch's AdamW, or raggedfsdp's Muon (an AdamW for what is not a matrix), with state."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "dsd_optimizer":
        optimizer = rf.optim.Muon(params, adamw_params=lambda p, shape: len(shape) != 2)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-3)
    rf.checkpoint.init_optimizer_state(model, optimizer)
    return optimizer


def _load_plain(path: str) -> dict[str, torch.Tensor]:
    state = OddModel().state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def _no_strides(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with the tensors' strides (a field since torch 2.15) set to None."""
    out = {}
    for key, value in metadata.items():
        properties = getattr(value, "properties", None)
        if getattr(properties, "strides", None) is not None:
            value = dataclasses.replace(
                value, properties=dataclasses.replace(properties, strides=None)
            )
        out[key] = value
    return out


def _covers(chunks: list[Any], size: torch.Size) -> bool:
    return sum(c.sizes.numel() for c in chunks) == size.numel()


def test_checkpoint_metadata_matches_sharded_tensor_fsdp2_and_one_process() -> None:
    pytest.importorskip("torch.distributed._shard.sharded_tensor")
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's no_dist notice, below
        results = run_distributed(_save_and_load, WORLD, path)
        torch.manual_seed(1)
        dcp.save(OddModel().state_dict(), checkpoint_id=f"{path}/single", no_dist=True)
        names = ("rf", "sharded_tensor", "fsdp2", "single")
        meta = {name: FileSystemReader(f"{path}/{name}").read_metadata() for name in names}
        loaded = {name: _load_plain(f"{path}/{name}") for name in names}
        ours, before = meta["rf"], meta["sharded_tensor"]
        # What raggedfsdp wrote with ShardedTensor: the same metadata (but for the strides that
        # torch >= 2.15 records and ShardedTensor leaves out) and the same bytes.
        assert _no_strides(ours.state_dict_metadata) == _no_strides(before.state_dict_metadata)
        assert ours.storage_data == before.storage_data
        for rank in range(WORLD):
            file = f"__{rank}_0.distcp"
            assert filecmp.cmp(f"{path}/rf/{file}", f"{path}/sharded_tensor/{file}", False)
    for rank, result in enumerate(results):
        assert result["warnings"] == [], rank
        assert result["sharded"], rank  # DSD's cpu_offload keeps RaggedTensors (on the CPU)
        assert result["control"], rank  # negative control: the check does see the warning
        assert "size mismatch for emb.weight" in result["errors"]["shape"], rank
        for kind in ("optimizer", "dsd_optimizer"):
            assert "rectangles do not match this rank's layout" in result["errors"][kind], rank
        assert (
            "mixes sharded tensors of different layouts"
            in (result["errors"]["dsd_torch_optimizer_step"])
        ), rank
    for name in ("fsdp2", "single"):
        theirs = meta[name].state_dict_metadata
        assert theirs.keys() == ours.state_dict_metadata.keys()
        for key, mine in ours.state_dict_metadata.items():
            assert (mine.size, mine.properties) == (theirs[key].size, theirs[key].properties)
            assert _covers(mine.chunks, mine.size) and _covers(theirs[key].chunks, mine.size)
    for name in names:
        for key, value in loaded["single"].items():
            assert torch.equal(loaded[name][key], value), (name, key)
            assert torch.equal(results[0]["full"][key], value), key
            assert torch.equal(results[0]["resharded"][key], value), key
