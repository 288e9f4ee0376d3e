"""Compressed communication's loose ends on a real 2-rank Gloo launch: a ``reduce_dtype`` the
compressed reduce-scatter cannot honour is refused at construction, naming both settings; a
non-finite gradient on one rank, in a block another rank owns, raises the same error naming the
parameter on EVERY rank, and every rank can still run the next collective; the all-gather's
shard is quantized once per optimizer step, also across gradient-accumulation micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import raggedfsdp as rf
from compression_reduce import SHAPES, Probe
from harness import error_message, run_distributed
from raggedfsdp.runtime.compression import BucketCodec

INT8 = rf.CommCompression(reduce_scatter=torch.int8)


def _build(mp: rf.MixedPrecisionPolicy, compression: rf.CommCompression) -> str:
    model = Probe(SHAPES)
    return error_message(
        lambda: rf.FSDPBackend(
            model,
            shard_policy=rf.RaggedShard(block_size=4),
            mp_policy=mp,
            compression=compression,
        )
    )


def _reduce_dtypes(rank: int, world: int) -> dict[str, str]:
    bf16 = torch.bfloat16
    return {
        "bf16": _build(rf.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), INT8),
        "fp32": _build(rf.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32), INT8),
        "none": _build(rf.MixedPrecisionPolicy(param_dtype=bf16), INT8),
        "gather_only": _build(
            rf.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16),
            rf.CommCompression(all_gather=torch.int8),
        ),
    }


def _non_finite(rank: int, world: int) -> tuple[str, list[float], bool]:
    """Rank 1 puts a NaN into the gradient of ``a`` at element 0, which rank 0 owns."""
    model = Probe(SHAPES)
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4), compression=INT8)
    start, end = rf.layout_of(model.a).ranges[0]
    owned_by_0 = start == 0 < end
    targets = {n: torch.ones(s) for n, s in SHAPES.items()}
    if rank == 1:
        targets["a"].view(-1)[0] = float("nan")
    message = error_message(lambda: model(targets).backward())
    after = torch.ones(1) * (rank + 1)
    dist.all_reduce(after)  # the next collective: every rank reaches it
    return message, after.tolist(), owned_by_0


def _encodes_per_step(rank: int, world: int) -> tuple[list[int], int]:
    """Encodes of the all-gather's shard after each of two optimizer steps of two micro-batches
    (the first under ``no_sync``), and the number of buckets."""
    calls = []
    original = BucketCodec.encode

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    BucketCodec.encode = counting  # type: ignore[method-assign]
    try:
        model = Probe(SHAPES)
        comp = rf.CommCompression(all_gather=torch.int8)
        rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4), compression=comp)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        targets = {n: torch.ones(s) for n, s in SHAPES.items()}
        counts = []
        for _ in range(2):
            with model.no_sync():
                model(targets).backward()
            model(targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            counts.append(len(calls))
    finally:
        BucketCodec.encode = original  # type: ignore[method-assign]
    return counts, len(model.shard_plans())


def _cases(rank: int, world: int) -> dict:
    return {
        "reduce_dtype": _reduce_dtypes(rank, world),
        "non_finite": _non_finite(rank, world),
        "encodes": _encodes_per_step(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_cases, 2, timeout=120.0, pg_timeout=60.0)


def test_reduce_dtype_that_cannot_be_honoured_is_refused(results):
    for result in results:
        errors = result["reduce_dtype"]
        assert "mp_policy.reduce_dtype=torch.bfloat16" in errors["bf16"], errors
        assert "CommCompression(reduce_scatter=torch.int8)" in errors["bf16"], errors
        assert errors["fp32"] == errors["none"] == errors["gather_only"] == "no error", errors


def test_non_finite_gradient_raises_the_same_error_on_every_rank(results):
    messages = [result["non_finite"][0] for result in results]
    assert all(result["non_finite"][2] for result in results)
    assert "parameter 'a' on rank 1 has a non-finite value" in messages[0], messages
    assert messages[0] == messages[1]
    assert [result["non_finite"][1] for result in results] == [[3.0], [3.0]]


def test_all_gather_shard_quantized_once_per_optimizer_step(results):
    for result in results:
        counts, buckets = result["encodes"]
        assert counts == [buckets, 2 * buckets]
