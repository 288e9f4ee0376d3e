"""RaggedTensor, DCP's container of a ragged shard: what it holds and allows, what DCP writes from
it (the same as torch's former ShardedTensor wrote, and comparable to FSDP2's and one process's
checkpoints), and that the package no longer uses the deprecated ShardedTensor."""

from __future__ import annotations

import filecmp
import pickle
import tempfile
import warnings
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import raggedfsdp as rf
from harness import error_message, run_distributed
from parity_models import OddModel
from raggedfsdp.runtime import RaggedTensor, local_flat, to_ragged_tensor

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


def _piece() -> tuple[rf.ShardLayout, torch.Tensor, torch.Tensor]:
    """A [5, 6] tensor over 3 ranks; rank 1 holds elements [8, 23): three rectangles."""
    layout = rf.ShardLayout(torch.Size([5, 6]), 1, ((0, 8), (8, 23), (23, 30)))
    full = torch.arange(30.0).view(5, 6)
    return layout, full, layout.to_local(full, 1).reshape(-1).clone()


def test_rectangles_are_views_of_the_piece() -> None:
    layout, full, piece = _piece()
    value = to_ragged_tensor(piece, layout, 1, None)
    assert isinstance(value, RaggedTensor) and not isinstance(piece, RaggedTensor)
    assert (value.shape, value.dtype) == (full.shape, full.dtype)
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
        assert item.tensor_data.properties == TensorProperties(dtype=torch.float32)
    with pytest.raises(ValueError, match="no rectangle"):
        value.__get_tensor_shard__(MetadataIndex("w", torch.Size([0, 0])))


def test_state_dict_operations_keep_the_container_and_others_are_refused() -> None:
    layout, _, piece = _piece()
    value = to_ragged_tensor(piece, layout, 1, None)
    detached = value.detach()
    assert isinstance(detached, RaggedTensor)
    assert local_flat(detached).data_ptr() == piece.data_ptr()
    assert value.to("cpu") is value  # nothing to do: DSD's cpu_offload on a CPU value
    wider = value.to(torch.float64)
    assert isinstance(wider, RaggedTensor) and torch.equal(local_flat(wider), piece.double())
    copy = value.clone()
    assert torch.equal(local_flat(copy), piece) and local_flat(copy).data_ptr() != piece.data_ptr()
    with pytest.raises(NotImplementedError, match="local_flat"):
        value + 1
    assert repr(value).startswith("RaggedTensor(shape=[5, 6], dtype=torch.float32, rank=1")
    with pytest.raises(ValueError, match="has 15 elements, got 14"):
        to_ragged_tensor(piece[:14], layout, 1, None)


def test_copies_and_pickles_as_its_piece_and_place() -> None:
    layout, _, piece = _piece()
    value = to_ragged_tensor(piece, layout, 1, None)
    for copy in (deepcopy(value), pickle.loads(pickle.dumps(value))):
        assert isinstance(copy, RaggedTensor)
        assert copy.shard_layout == layout and copy.shard_rank == 1
        assert torch.equal(local_flat(copy), piece)
        assert local_flat(copy).data_ptr() != piece.data_ptr()
        first = copy.rectangles[0][1]
        assert local_flat(copy).data_ptr() == first.data_ptr()  # views again


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

    layout, views = value.shard_layout, iter(view for _, view in value.rectangles)
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
        "plan": error_message(lambda: model.load_state_dict(other.state_dict())),
        **_optimizer_plan_errors(model, other),
    }
    return {
        "full": full,
        "sharded": sharded,
        "warnings": _deprecations(caught),
        "control": _deprecations(control),
        "errors": errors,
    }


def _optimizer_plan_errors(model: torch.nn.Module, other: torch.nn.Module) -> dict[str, str]:
    """Optimizer state of another plan, handed over without DCP (which would reshard it):
    through raggedfsdp's functions and through DSD."""
    optimizers = []
    for m in (model, other):
        optimizers.append(torch.optim.AdamW(m.parameters(), lr=1e-3))
        rf.checkpoint.init_optimizer_state(m, optimizers[-1])
    ours, theirs = optimizers
    state = rf.optim_state_dict(other, theirs)
    dsd_state = get_optimizer_state_dict(other, theirs)
    return {
        "optimizer": error_message(lambda: rf.load_optim_state_dict(model, ours, state)),
        "dsd_optimizer": error_message(lambda: set_optimizer_state_dict(model, ours, dsd_state)),
    }


def _load_plain(path: str) -> dict[str, torch.Tensor]:
    state = OddModel().state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


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
        # What raggedfsdp wrote with ShardedTensor: the same metadata and the same bytes.
        assert ours.state_dict_metadata == before.state_dict_metadata
        assert ours.storage_data == before.storage_data
        for rank in range(WORLD):
            file = f"__{rank}_0.distcp"
            assert filecmp.cmp(f"{path}/rf/{file}", f"{path}/sharded_tensor/{file}", False)
    for rank, result in enumerate(results):
        assert result["warnings"] == [], rank
        assert result["sharded"], rank  # DSD's cpu_offload keeps RaggedTensors (on the CPU)
        assert result["control"], rank  # negative control: the check does see the warning
        assert "expected the full shape [37, 24]" in result["errors"]["shape"], rank
        for kind in ("plan", "optimizer", "dsd_optimizer"):
            assert "rectangles do not match this rank's layout" in result["errors"][kind], rank
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
