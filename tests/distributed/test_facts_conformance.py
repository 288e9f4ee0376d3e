"""raggedfsdp's description in the room of shared facts (``raggedfsdp.facts.RAGGEDFSDP``), which
the cost model costs, held to what its runtime records, fact by fact, so the two cannot drift
apart again (CPU offload's copies were once costed on the compute stream after the runtime had
moved them to the copy-in and reduce streams):

- ``ragged``: each rank's shard of a bucket is the plan's ``S`` (beside FSDP2's padded rows);
- ``zero_copy``: every unsharded parameter is a view of its bucket's all-gather buffer (or,
  held whole, of its shard);
- ``collective_per_bucket`` and ``keeps_last_block_unsharded``: the cost model's all-gathers
  and reduce-scatters per step equal ``stats()``'s, and each unit's all-gathers per step (its
  copy-in events in the stream log) are one, or two for a block resharded after forward;
- ``gloo_reduce_scatter``: the collective log holds no all-reduce of a gradient (point to point);
- ``agrees_on_usage``: one all-reduce of which parameters any rank used per step (two under
  HSDP: one per mesh dim);
- ``compresses``: under ``CommCompression`` the wire carries messages of codes, not fp32;
- ``host_copies``: the stream each offload copy runs on (host to device; device to host, under
  HSDP too), the bytes each direction moves per step (the cost model's ``host_copy_bytes``) and
  what is staged (the cost model's ``offload_staging_bytes``).

One comparison (:func:`differences`) judges a description against the records; negative
controls flip each fact (and take the stale description of the offload copies) and are each
caught by the same comparison. One Gloo launch of 2 ranks runs every case.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import raggedfsdp as rf
from collective_wrap import Record, Recorder, wrapped_collectives
from harness import patched, run_distributed
from parity_models import Block, OddModel, make_batches
from raggedfsdp.capacity.cost import StepShape, UnitBytes, offload_staging_bytes, unit_bytes
from raggedfsdp.capacity.steptime import collective_bytes, host_copy_bytes
from raggedfsdp.facts import (
    FSDP2,
    RAGGEDFSDP,
    GlooReduceScatter,
    HostCopies,
    Staging,
    Stream,
    System,
)
from raggedfsdp.runtime._hooks import state_of
from raggedfsdp.runtime._offload import HostOffload
from raggedfsdp.runtime._pool import BufferPool

pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH = 2, 8
BF16 = rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
INT8 = rf.CommCompression(all_gather=torch.int8, reduce_scatter=torch.int8)

#: The cases: what each asks of ``fully_shard``. Small buckets: each block has several.
CASES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "offload_fp32": {"offload": True},
    "offload_bf16": {"offload": True, "mp": BF16},
    "offload_hsdp": {"offload": True, "hsdp": True},
    "compressed": {"compression": INT8},
}
BUFFER_SIZE = 3000  # bytes: five buckets a block, four at the root (one of them frozen)

# -- the launch -----------------------------------------------------------------------------------


def _build(world: int, case: dict[str, Any]) -> nn.Module:
    """OddModel (a frozen parameter at the root) with a third block, sharded per block and at
    the root."""
    torch.manual_seed(0)
    model = OddModel()
    model.blocks.append(Block())
    kwargs: dict[str, Any] = {
        "shard_policy": rf.RaggedShard(block_size=4),
        "mp_policy": case.get("mp"),
        "compression": case.get("compression"),
        "dbuffer_config": rf.DBufferConfig(
            buffer_size=BUFFER_SIZE, host_copies_on_cpu=case.get("offload", False)
        ),
    }
    if case.get("hsdp"):
        kwargs["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    if case.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        rf.fully_shard(block, **kwargs)
    rf.fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def _offload_spy(streams: Any, seen: dict[str, list]) -> Iterator[None]:
    """Each offload copy's stream and bytes, and the pool blocks taken while copying to the
    device (what is staged)."""
    to_device, to_host, take = HostOffload.to_device, HostOffload.to_host, BufferPool.take
    copying = []

    def device_copy(self, slot, local, pool, stats):  # type: ignore[no-untyped-def]
        seen["to_device"].append((streams.current().name, local.numel() * local.element_size()))
        copying.append(True)
        try:
            return to_device(self, slot, local, pool, stats)
        finally:
            copying.pop()

    def host_copy(self, reduced, dtype, stats):  # type: ignore[no-untyped-def]
        host = to_host(self, reduced, dtype, stats)
        seen["to_host"].append((streams.current().name, host.numel() * host.element_size()))
        return host

    def taking(pool, numel, dtype, device):  # type: ignore[no-untyped-def]
        if copying:
            seen["staged"].append(numel * dtype.itemsize)
        return take(pool, numel, dtype, device)

    with (
        patched(HostOffload, to_device=device_copy, to_host=host_copy),
        patched(BufferPool, take=taking),
    ):
        yield


def _views_of_buffers(units: list[nn.Module]) -> list[bool]:
    """Replace each unit's forward with one that first checks, its parameters unsharded,
    whether each is a view of its bucket's all-gather buffer or of its shard; the checks'
    results are appended to the returned list."""
    results: list[bool] = []
    for unit in units:
        group = state_of(unit).group  # type: ignore[union-attr]
        forward = unit.forward

        def checked(*args: Any, _group: Any = group, _forward: Any = forward) -> Any:
            for bucket in _group.buckets:
                own = {bucket.full.untyped_storage().data_ptr()}
                own.add(bucket.local.untyped_storage().data_ptr())
                for param in bucket.params:
                    results.append(param.unsharded_local().untyped_storage().data_ptr() in own)
            return _forward(*args)

        unit.forward = checked  # type: ignore[method-assign]
    return results


def _observe(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One AdamW step to set up (lazy init, the unit order), then one recorded step."""
    model = _build(world, case)
    units = [*model.blocks, model]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per = GLOBAL_BATCH // world
    batches = [
        (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        for x, y in make_batches(2, GLOBAL_BATCH)
    ]
    model(*batches[0]).backward()
    opt.step()
    opt.zero_grad()
    groups = [state_of(u).group for u in units]  # type: ignore[union-attr]
    streams = state_of(model).ctx.shared.streams  # type: ignore[union-attr]
    views = _views_of_buffers(units)
    recorder = Recorder()
    seen: dict[str, list] = {"to_device": [], "to_host": [], "staged": []}
    model.reset_stats()
    streams.log = []
    with wrapped_collectives(recorder), _offload_spy(streams, seen):
        model(*batches[1]).backward()
    log, streams.log = streams.log, None
    stats = model.stats()
    return {
        "units": [unit_bytes([b.plan for b in g.buckets])[0] for g in groups],
        "local_numels": [sum(b.local.numel() for b in g.buckets) for g in groups],
        "unshards": [
            sum(1 for e in log if e[0] == "record" and e[3] == f"copy_in:{g.label}") for g in groups
        ],
        "all_gather_calls": int(stats["all_gather_calls"]),
        "reduce_scatter_calls": int(stats["reduce_scatter_calls"]),
        "views": all(views) and bool(views),
        "kinds": sorted({r.kind for r in recorder.records if not _usage_mask(r)}),
        "usage_all_reduces": sum(1 for r in recorder.records if _usage_mask(r)),
        "dtypes": sorted({r.dtype for r in recorder.records}),
        **seen,
    }


def _usage_mask(record: Record) -> bool:
    """The all-reduce of which parameters any rank used (bytes), not of a gradient."""
    return record.kind == "all_reduce" and record.dtype == "torch.uint8"


def _cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {name: _observe(rank, world, case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def observed() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_cases, WORLD, timeout=600)


# -- the comparison -------------------------------------------------------------------------------


def _step(case: dict[str, Any]) -> StepShape:
    mp = case.get("mp")
    return StepShape(
        batch=GLOBAL_BATCH // WORLD,
        seq_len=6,
        param_dtype=mp.param_dtype if mp is not None else torch.float32,
        gloo=True,
        offload=case.get("offload", False),
    )


def differences(system: System, name: str, seen: dict[str, Any]) -> list[str]:
    """Each fact of ``system`` that what one rank recorded in case ``name`` contradicts, in
    words (empty: the description holds)."""
    case = CASES[name]
    units: list[UnitBytes] = seen["units"]
    step = _step(case)
    out = []

    def compare(fact: str, described: object, recorded: object) -> None:
        if described != recorded:
            out.append(f"{name}: {fact}: described {described!r}, recorded {recorded!r}")

    compare("ragged (shard per unit)", [u.shard(system) for u in units], seen["local_numels"])
    compare("zero_copy", system.zero_copy, seen["views"])
    blocks = len(units) - 1
    again = set(system.regathered(blocks))
    compare(
        "keeps_last_block_unsharded (all-gathers per unit)",
        [2 if i in again else 1 for i in range(blocks)] + [1],
        seen["unshards"],
    )
    if not case.get("hsdp") and not case.get("compression"):
        calls = collective_bytes(units, step, WORLD, system)
        compare("all-gathers per step", calls.all_gather_calls, seen["all_gather_calls"])
        compare(
            "reduce-scatters per step", calls.reduce_scatter_calls, seen["reduce_scatter_calls"]
        )
    compare(
        "agrees_on_usage (all-reduces per step)",
        int(system.agrees_on_usage) * (2 if case.get("hsdp") else 1),
        seen["usage_all_reduces"],
    )
    if not case.get("hsdp"):
        compare(
            "gloo_reduce_scatter",
            system.gloo_reduce_scatter is GlooReduceScatter.ALL_REDUCE,
            "all_reduce" in seen["kinds"],
        )
    if case.get("compression"):
        # compressed messages travel as bytes of codes and scales, never as fp32
        compare("compresses", system.compresses, "torch.float32" not in seen["dtypes"])
    if case.get("offload"):
        copies = system.host_copies
        to_host = copies.to_host_replicated if case.get("hsdp") else copies.to_host
        compare(
            "host copies to the device", {copies.to_device.value}, {s for s, _ in seen["to_device"]}
        )
        compare("host copies to the host", {to_host.value}, {s for s, _ in seen["to_host"]})
        h2d, d2h = host_copy_bytes(units, step, system)
        gathered = sum(h2d) + sum(h2d[i] for i in again)
        compare("bytes to the device", gathered, sum(b for _, b in seen["to_device"]))
        compare("bytes to the host", sum(d2h), sum(b for _, b in seen["to_host"]))
        staged = offload_staging_bytes(units, step) if copies.staging is Staging.POOLED_CAST else 0
        compare("staging", staged, sum(set(seen["staged"])))
    return out


def test_raggedfsdp_is_as_described(observed):
    for rank, cases in enumerate(observed):
        for name, seen in cases.items():
            assert differences(RAGGEDFSDP, name, seen) == [], (rank, name)


def test_the_records_are_not_empty(observed):
    """What the comparison reads was recorded at all (else equal empties would pass)."""
    seen = observed[0]
    assert seen["fp32"]["all_gather_calls"] > 0 and seen["fp32"]["unshards"] == [2, 2, 1, 1]
    assert [u.buckets for u in seen["fp32"]["units"]] == [5, 5, 5, 4]
    assert {"send", "recv"} <= set(seen["fp32"]["kinds"])
    assert seen["offload_bf16"]["staged"] and not seen["offload_fp32"]["staged"]
    offload = seen["offload_fp32"]  # a copy per bucket gathered, and per bucket reduced
    assert len(offload["to_device"]) == offload["all_gather_calls"] == 29
    assert len(offload["to_host"]) == offload["reduce_scatter_calls"] == 18
    assert seen["offload_hsdp"]["to_host"][0][0] == Stream.ALL_REDUCE.value


def _host_copies(**changes: Any) -> HostCopies:
    return dataclasses.replace(RAGGEDFSDP.host_copies, **changes)


#: Wrong descriptions, each one fact off, and the fact the comparison must name.
WRONG: dict[str, tuple[System, str]] = {
    "offload copies on the compute stream (the stale description)": (
        dataclasses.replace(
            RAGGEDFSDP,
            host_copies=_host_copies(to_device=Stream.COMPUTE, to_host=Stream.COMPUTE),
        ),
        "host copies to the device",
    ),
    "copies back on the all-reduce stream without HSDP": (
        dataclasses.replace(RAGGEDFSDP, host_copies=_host_copies(to_host=Stream.ALL_REDUCE)),
        "host copies to the host",
    ),
    "copies back on the reduce-scatter stream under HSDP": (
        dataclasses.replace(
            RAGGEDFSDP, host_copies=_host_copies(to_host_replicated=Stream.REDUCE_SCATTER)
        ),
        "offload_hsdp: host copies to the host",
    ),
    "FSDP2's staging": (
        dataclasses.replace(
            RAGGEDFSDP, host_copies=_host_copies(staging=Staging.PREFETCHED_SHARDS)
        ),
        "offload_bf16: staging",
    ),
    "one collective per unit": (
        dataclasses.replace(RAGGEDFSDP, collective_per_bucket=False),
        "all-gathers per step",
    ),
    "the last block resharded after forward": (
        dataclasses.replace(RAGGEDFSDP, keeps_last_block_unsharded=False),
        "keeps_last_block_unsharded",
    ),
    "a copy of the gathered parameters": (
        dataclasses.replace(RAGGEDFSDP, zero_copy=False),
        "zero_copy",
    ),
    "no compression": (dataclasses.replace(RAGGEDFSDP, compresses=False), "compresses"),
    "an all-reduce on Gloo": (
        dataclasses.replace(RAGGEDFSDP, gloo_reduce_scatter=GlooReduceScatter.ALL_REDUCE),
        "gloo_reduce_scatter",
    ),
    "FSDP2's description": (FSDP2, "ragged"),
    "no agreement on usage": (
        dataclasses.replace(RAGGEDFSDP, agrees_on_usage=False),
        "agrees_on_usage",
    ),
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_description_is_caught(observed, wrong):
    """Negative controls: the same comparison names the fact that is off."""
    system, fact = WRONG[wrong]
    found = [d for name, seen in observed[0].items() for d in differences(system, name, seen)]
    assert any(fact in d for d in found), found
