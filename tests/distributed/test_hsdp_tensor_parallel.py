"""HSDP beside tensor parallelism: one launch of 8 Gloo ranks on a (dp_replicate=2, dp_shard=2,
tp=2) mesh trains a small GPT split by the job's tensor-parallel plan
(:mod:`raggedfsdp.models.tensor_parallel`: q k v and fc column-parallel, the projections
row-parallel, the tied embedding and head by vocabulary) and then sharded over the two
data-parallel dims -- with rf.fully_shard and with FSDP2 in the same launch, against one process
on the global batch (3 AdamW steps, fp32, 1e-5). Each tensor-parallel group reads one of the 4
data ranks' sequences; the gradients are reduce-scattered over dp_shard and all-reduced over
dp_replicate, and never over tp. The parameters carry the three placements.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import Replicate, Shard

import raggedfsdp as rf
from harness import assert_close_dicts, run_distributed
from raggedfsdp.models import GPT, GPTConfig
from raggedfsdp.models.tensor_parallel import parallelize_tensor

REPLICATE, SHARD, TP = 2, 2, 2
DATA_RANKS = REPLICATE * SHARD
CONFIG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
SEQUENCES = 2  # per data rank
IMPLS = {"rf": rf.fully_shard, "fsdp2": fsdp2_fully_shard}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    shape = (SEQUENCES * DATA_RANKS, CONFIG.seq_len)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
            torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
        )
        for _ in range(3)
    ]


def _train(model: nn.Module, data_rank: int | None) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        if data_rank is not None:
            rows = slice(data_rank * SEQUENCES, (data_rank + 1) * SEQUENCES)
            x, y = x[rows], y[rows]
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _grid(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (REPLICATE, SHARD, TP), mesh_dim_names=names)
    data_rank = rank // TP  # tp innermost: a tensor-parallel group shares its sequences
    torch.manual_seed(0)
    base = GPT(CONFIG)
    reference = copy.deepcopy(base)
    _train(reference, None)
    out: dict[str, Any] = {"reference": dict(reference.state_dict())}
    for impl, shard in IMPLS.items():
        model = parallelize_tensor(copy.deepcopy(base), mesh["tp"])
        for block in model.blocks:
            shard(block, mesh=mesh["dp_replicate", "dp_shard"])
        shard(model, mesh=mesh["dp_replicate", "dp_shard"])
        _train(model, data_rank)
        weight = model.blocks[0].attn.q_proj.weight
        out[impl] = {
            "placements": [str(p) for p in weight.placements],
            "dims": weight.device_mesh.mesh_dim_names,
            "trained": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
        }
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(_grid, REPLICATE * SHARD * TP)


def test_hsdp_x_tp_trains_as_one_process_and_as_fsdp2(grid):
    for rank in grid:
        assert_close_dicts(rank["rf"]["trained"], rank["reference"])
        assert_close_dicts(rank["fsdp2"]["trained"], rank["reference"])


def test_parameters_carry_the_three_placements(grid):
    for rank in grid:
        assert rank["rf"]["dims"] == ("dp_replicate", "dp_shard", "tp")
        assert rank["rf"]["placements"] == [str(Replicate()), "RS", str(Shard(0))]
        # FSDP2 shards dim 0 under the tensor-parallel split (a strided shard)
        replicated, _, tensor_parallel = rank["fsdp2"]["placements"]
        assert (replicated, tensor_parallel) == (str(Replicate()), str(Shard(0)))
