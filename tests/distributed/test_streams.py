"""The communication streams ([Note: streams and events] in ``runtime/_streams.py``), checked on
the CPU, where streams order nothing: the stand-in streams record every event and wait, and
``stream_trace`` replays them with what ran on each stream (every op's reads and writes, every
collective from its issue to its wait) as a GPU would run them. Per traced step, as FSDP2 does:

- the copy-in (casts, quantizing, the host shard's copy) runs on the copy-in stream, after the
  compute stream's event that follows the optimizer step (or the post-optimizer event instead);
- the compute stream waits for a unit's all-gather event before its forward reads the unit's
  parameters;
- the reduce-scatter stream waits for the compute stream before it reads the gradients;
- a pool block is taken again only after the event of the stream that gave it back;
- no two streams touch the same bytes unordered (a write among them).

Negative controls plant one missing wait each, and each is caught. Training with the streams
equals training on one stream bit for bit, and ``set_post_optim_event`` replaces the compute
wait of the next all-gathers. One launch of 2 ranks runs every case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

import raggedfsdp as rf
from collective_wrap import emulated_when
from harness import run_distributed
from parity_models import Block, OddModel, make_batches
from raggedfsdp.runtime._hooks import state_of, states_under
from raggedfsdp.runtime._streams import Streams
from stream_trace import Stamped, describe, happens_before, races, replay, tracing

pytestmark = pytest.mark.slow

WORLD, STEPS, GLOBAL_BATCH = 2, 3, 8  # the first step untraced: it records the unit order
INT8 = torch.int8

#: Traced configurations: every strategy of the all-gather and the reduce-scatter.
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "native": {"native": True},  # NCCL's calls, under its asynchrony emulated
    "bf16": {"mp": rf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    "compressed": {"compression": rf.CommCompression(all_gather=INT8, reduce_scatter=INT8)},
    "hsdp": {"hsdp": True},
    "copy-path": {"zero_copy": False},
    "offload": {"offload": True},
}

# -- planted bugs ---------------------------------------------------------------------------------


def _skip_waits(label: str):  # type: ignore[no-untyped-def]
    """``Streams.wait`` that drops waits for events whose label starts with ``label``."""
    wait = Streams.wait

    def planted(self: Streams, event: Any, stream: Any = None) -> None:
        if not getattr(event, "label", "").startswith(label):
            wait(self, event, stream)

    return planted


#: name -> (Streams method, its planted replacement): one missing wait each.
PLANTS = {
    "compute skips the all-gather event": ("wait", lambda: _skip_waits("all_gather:")),
    "reduce-scatter skips the gradients": ("wait", lambda: _skip_waits("gradients:")),
    "pool skips the block's event": ("wait", lambda: _skip_waits("pool")),
    "copy-in skips compute": ("order_gathers", lambda: lambda self: None),
}


@contextlib.contextmanager
def _planted(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    method, make = PLANTS[name]
    saved = getattr(Streams, method)
    setattr(Streams, method, make())
    try:
        yield
    finally:
        setattr(Streams, method, saved)


# -- one traced run -------------------------------------------------------------------------------


def _build(world: int, case: dict[str, Any]) -> nn.Module:
    """OddModel with three blocks, sharded per block and at the root, as ``case`` says."""
    torch.manual_seed(0)
    model = OddModel()
    # A third block of the same size: within a backward a unit then takes the gradient block
    # that the unit two before it gave back, with no other event between the two streams.
    model.blocks.append(Block())
    kwargs: dict[str, Any] = {
        "shard_policy": rf.RaggedShard(block_size=4),
        "mp_policy": case.get("mp"),
        "compression": case.get("compression"),
        "dbuffer_config": rf.DBufferConfig(
            gloo_point_to_point=not case.get("native", False),
            zero_copy=case.get("zero_copy", True),
            host_copies_on_cpu=case.get("offload", False),
        ),
    }
    if case.get("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    if case.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        rf.fully_shard(block, **kwargs)
    rf.fully_shard(model, **kwargs)
    return model


def _run(rank: int, world: int, case: dict[str, Any], *, traced: bool = True, post_optim=False):  # type: ignore[no-untyped-def]
    """``STEPS`` AdamW steps, all but the first traced (unless not ``traced``); the model and
    the trace's log."""
    model = _build(world, case)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    per = GLOBAL_BATCH // world
    batches = [
        (idx[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per])
        for idx, targets in make_batches(STEPS, GLOBAL_BATCH)
    ]
    with emulated_when(case.get("native", False)):
        _step(model, opt, *batches[0], None, post_optim=False)  # lazy init, the unit order
        streams = state_of(model).ctx.shared.streams  # type: ignore[union-attr]
        with tracing(streams) if traced else contextlib.nullcontext() as trace:
            for unit in [*model.blocks, model] if traced else []:
                unit.register_forward_pre_hook(_marker(trace, unit))
            for x, y in batches[1:]:
                _step(model, opt, x, y, trace, post_optim=post_optim)
    return model, trace.log if traced else []


def _marker(trace, unit: nn.Module):  # type: ignore[no-untyped-def]
    label = state_of(unit).group.label  # type: ignore[union-attr]

    def hook(module: nn.Module, args: Any) -> None:
        if trace.streams.log is not None:  # only while traced
            trace.op(f"forward {label}")

    return hook


def _step(model, opt, x, y, trace, *, post_optim: bool) -> None:  # type: ignore[no-untyped-def]
    opt.zero_grad()
    model(x, y).backward()
    if trace is not None:
        trace.op("optimizer")
    opt.step()
    if post_optim and trace is not None:
        event = trace.streams.record(label="post_optim")
        model.set_post_optim_event(event)
    if trace is not None:
        torch.ones(4).add_(1)  # unrelated compute queued after the step
        trace.op("after optimizer")


# -- the checks -----------------------------------------------------------------------------------


def _gather_storages(model: nn.Module) -> dict[int, str]:
    """Each unit's all-gather storage (its StorageImpl) -> the unit's label."""
    out = {}
    for state in states_under(model):
        for storage in state.group._gather_storage:
            out[storage._bytes.untyped_storage()._cdata] = state.group.label
    return out


def _checks(model: nn.Module, log: list) -> dict[str, Any]:
    """What the trace shows, judged by the tests."""
    stamped = replay(log)
    gathers = _gather_storages(model)
    found = races(stamped)
    return {
        "entries": len(stamped),
        "races": len(found),
        "race_examples": [describe(r) for r in found[:8]],
        "copy_in_streams": _writers(stamped, gathers),
        "forward_before_gather": _forward_before_gather(stamped, gathers),
        "gradients_unordered": sum(
            1 for a, b in found if a.stream == "compute" and b.stream.startswith("reduce_scatter")
        ),
        "copy_in_before_optimizer": _before(stamped, "optimizer"),
        "copy_in_after_unrelated": _after_first(stamped, "after optimizer"),
        "pool_reused_early": _pool_reused_early(stamped),
    }


def _writers(stamped: list[Stamped], gathers: dict[int, str]) -> dict[str, list[str]]:
    """Op name -> the streams on which it wrote into a unit's all-gather storage."""
    out: dict[str, set[str]] = {}
    for s in stamped:
        if s.entry[0] == "access" and s.entry[5] and s.entry[2] in gathers:
            op = s.entry[6] if not s.stream.startswith("collective") else "collective"
            out.setdefault(op, set()).add(s.stream)
    return {op: sorted(streams) for op, streams in out.items()}


def _forward_before_gather(stamped: list[Stamped], gathers: dict[int, str]) -> list[str]:
    """Forwards of a unit not ordered after every earlier write into its all-gather storage."""
    bad = []
    for f in stamped:
        if f.entry[0] != "op" or not f.entry[2].startswith("forward "):
            continue
        unit = f.entry[2].removeprefix("forward ")
        for w in stamped[: stamped.index(f)]:
            writes = w.entry[0] == "access" and w.entry[5] and gathers.get(w.entry[2]) == unit
            if writes and not happens_before(w, f):
                bad.append(f"{unit}: {w.entry[6]} on {w.stream}")
                break
    return bad


def _markers(stamped: list[Stamped], what: str) -> list[Stamped]:
    return [s for s in stamped if s.entry[0] == "op" and s.entry[2] == what]


def _gathering(stream: str) -> bool:
    """The copy-in stream, the all-gather stream and the collectives it issued."""
    return stream.startswith("all_gather")


def _before(stamped: list[Stamped], marker: str) -> int:
    """All-gather accesses (copy-in, collective) not ordered after the last ``marker``."""
    bad, last = 0, None
    for s in stamped:
        if s.entry[0] == "op" and s.entry[2] == marker:
            last = s
        elif _gathering(s.stream) and last is not None and not happens_before(last, s):
            bad += 1
    return bad


def _after_first(stamped: list[Stamped], marker: str) -> list[bool]:
    """Per ``marker``: whether the first all-gather access after it is ordered after it."""
    out = []
    for m in _markers(stamped, marker):
        later = [s for s in stamped[stamped.index(m) :] if _gathering(s.stream)]
        if later:
            out.append(happens_before(m, later[0]))
    return out


def _pool_reused_early(stamped: list[Stamped]) -> int:
    """Blocks taken again not ordered after their giving back."""
    bad, given = 0, {}
    for s in stamped:
        if s.entry[0] != "op":
            continue
        kind, _, block = s.entry[2].partition(" ")
        if kind == "give":
            given[block] = s
        elif kind == "take" and block in given and not happens_before(given[block], s):
            bad += 1
    return bad


# -- the launch -----------------------------------------------------------------------------------


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"traced": {}, "planted": {}, "parity": {}}
    for name, case in CASES.items():
        model, log = _run(rank, world, case)
        out["traced"][name] = _checks(model, log)
    for plant in PLANTS:
        with _planted(plant):
            model, log = _run(rank, world, CASES["plain"])
        out["planted"][plant] = _checks(model, log)
    model, log = _run(rank, world, CASES["plain"], post_optim=True)
    out["post_optim"] = _checks(model, log)
    for name in ("plain", "bf16", "compressed"):
        with_streams, _ = _run(rank, world, CASES[name], traced=False)
        with _one_stream():
            one_stream, _ = _run(rank, world, CASES[name], traced=False)
        a, b = rf.full_state_dict(with_streams), rf.full_state_dict(one_stream)
        out["parity"][name] = all(torch.equal(a[k], b[k]) for k in a)
    return out


@contextlib.contextmanager
def _one_stream() -> Iterator[None]:
    """Every root's streams made with ``separate=False``: one stream, no events."""
    init = Streams.__init__

    def single(self: Streams, device: torch.device, *, separate: bool = True) -> None:
        init(self, device, separate=False)

    Streams.__init__ = single  # type: ignore[method-assign]
    try:
        yield
    finally:
        Streams.__init__ = init  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return run_distributed(_all_cases, WORLD, timeout=600)


def test_the_trace_is_race_free(grid):
    for rank, results in enumerate(grid):
        for name, checks in results["traced"].items():
            assert checks["entries"] > 100, (rank, name)  # it did trace the steps
            assert checks["races"] == 0, (rank, name, checks["race_examples"])


def test_copy_in_runs_on_its_stream_after_the_optimizer(grid):
    for rank, results in enumerate(grid):
        for name, checks in results["traced"].items():
            writers = checks["copy_in_streams"]
            # Casts, the host shard's copy, Gloo's own slot and dequantizing: never on compute.
            assert all("compute" not in streams for streams in writers.values()), (name, writers)
            assert checks["copy_in_before_optimizer"] == 0, (rank, name)


def test_compute_waits_for_the_all_gather_before_a_units_forward(grid):
    for rank, results in enumerate(grid):
        for name, checks in results["traced"].items():
            assert checks["forward_before_gather"] == [], (rank, name)


def test_reduce_scatter_waits_for_the_gradients_and_pool_blocks_for_their_event(grid):
    for rank, results in enumerate(grid):
        for name, checks in results["traced"].items():
            assert checks["gradients_unordered"] == 0, (rank, name)
            assert checks["pool_reused_early"] == 0, (rank, name)


def test_negative_controls_a_missing_wait_is_caught(grid):
    caught_by = {
        "compute skips the all-gather event": "forward_before_gather",
        "reduce-scatter skips the gradients": "gradients_unordered",
        "pool skips the block's event": "pool_reused_early",
        "copy-in skips compute": "copy_in_before_optimizer",
    }
    for rank, results in enumerate(grid):
        for plant, checks in results["planted"].items():
            assert checks[caught_by[plant]], f"rank {rank}: {plant} was not caught"
            assert checks["races"] > 0, f"rank {rank}: {plant} left no race"


def test_post_optim_event_replaces_the_compute_wait(grid):
    for rank, results in enumerate(grid):
        plain = results["traced"]["plain"]["copy_in_after_unrelated"]
        with_event = results["post_optim"]["copy_in_after_unrelated"]
        # Without the event the first copy-in after a step waits for all compute queued so
        # far; with it only for the optimizer step.
        assert plain and all(plain), (rank, plain)
        assert with_event and not any(with_event), (rank, with_event)
        assert results["post_optim"]["copy_in_before_optimizer"] == 0, rank
        assert results["post_optim"]["races"] == 0, (rank, results["post_optim"]["race_examples"])


def test_training_on_the_streams_equals_one_stream_bit_for_bit(grid):
    for rank, results in enumerate(grid):
        assert results["parity"] and all(results["parity"].values()), (rank, results["parity"])
