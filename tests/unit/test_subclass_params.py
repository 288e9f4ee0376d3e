"""A parameter whose data is a tensor subclass raggedfsdp cannot shard is one clear error at
``fully_shard`` naming the parameter and the class, before any collective: never its inner data
gathered and trained in its place (issue 34, item 7). One rank of a fake world of two."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import raggedfsdp as rf
from fake_ranks import fake_world
from subclasses import Fp8CastWeight, Opaque


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(Opaque(model[1].weight.detach().clone()))
    return model


def test_a_subclass_without_the_protocol_is_refused_by_name_and_class() -> None:
    model = _model()
    with fake_world(0, 2), pytest.raises(TypeError) as error:
        rf.fully_shard(model)
    message = str(error.value)
    assert "'1.weight'" in message and "subclasses.Opaque" in message, message
    assert "fsdp_pre_all_gather" in message, message
    # Negative control: nothing was sharded, so nothing was silently dropped.
    assert type(model[1].weight) is Opaque
    assert not isinstance(model, rf.FSDPModule)


def test_the_same_parameter_ignored_or_plain_shards() -> None:
    model = _model()
    with fake_world(0, 2):
        rf.fully_shard(model, ignored_params={model[1].weight})
        assert type(model[1].weight) is Opaque  # left alone, as FSDP2 leaves ignored ones
        plain = nn.Sequential(nn.Linear(4, 4))
        rf.fully_shard(plain)
        assert isinstance(plain[0].weight, rf.RaggedTensor)
        assert type(plain[0].weight.to_local()) is torch.Tensor


def _fp8_model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    model[1].weight = nn.Parameter(Fp8CastWeight(model[1].weight.detach().clone()))
    return model


def test_a_protocol_parameter_keeps_its_class_in_its_shard() -> None:
    model = _fp8_model()
    with fake_world(1, 2):
        rf.fully_shard(model)
        sharded = model[1].weight
        assert isinstance(sharded, rf.RaggedTensor)
        assert type(sharded.to_local()) is Fp8CastWeight
        assert sharded.shape == (4, 5) and sharded.to_local().shape == (2, 5)  # rows 2..3
        assert type(model[0].weight.to_local()) is torch.Tensor  # plain ones in the buckets


def test_a_protocol_parameter_under_comm_compression_is_one_error_naming_it() -> None:
    """Item 6: the subclass's fsdp_pre_all_gather decides what its all-gather sends, so
    rf.CommCompression cannot quantize it too."""
    model = _fp8_model()
    compression = rf.CommCompression(all_gather=torch.float8_e4m3fn)
    with fake_world(0, 2), pytest.raises(ValueError) as error:
        rf.fully_shard(model, compression=compression)
    message = str(error.value)
    assert "'1.weight'" in message and "Fp8CastWeight" in message and "CommCompression" in message
    assert not isinstance(model, rf.FSDPModule)


def test_a_protocol_parameter_sharded_on_another_dim_is_one_error_naming_it() -> None:
    """FSDP2's ``Shard(dim > 0)`` (``shard_placement_fn``) is not followed for a protocol
    parameter yet: one error naming it, before any collective (the TP sub-mesh and CPU offload
    are followed: tests/distributed/test_tensor_parallel.py, test_tensor_subclasses.py)."""
    model = _fp8_model()
    with fake_world(0, 2), pytest.raises(NotImplementedError) as error:
        rf.fully_shard(model, shard_placement_fn=lambda param: Shard(param.dim() - 1))
    message = str(error.value)
    assert "'1.weight'" in message and "Fp8CastWeight" in message and "Shard(dim > 0)" in message
    assert not isinstance(model, rf.FSDPModule)
