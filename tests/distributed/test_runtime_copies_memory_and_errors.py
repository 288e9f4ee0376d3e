"""Runtime behaviour beyond parity: zero copy, memory, meta init, and bad input.

One launch of 4 ranks runs the cases at W = 2, 3 and 4, each as if launched on W ranks
(harness.run_world_grid, ``as_launches``); the tests judge the collected results. A rank that
fails runs in a launch of its own (it leaves its group unusable)."""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import raggedfsdp as rf
from harness import error_message, run_distributed, world_grid_fixture
from parity_models import OddModel, make_batches
from raggedfsdp.materialize import init_sharded_
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.models.gpt import init_parameter_

COPY_OPS = {
    "aten::copy_",
    "aten::clone",
    "aten::cat",
    "aten::_chunk_cat",
    "aten::split_with_sizes_copy",
    "aten::_to_copy",
}


def _ancestors(event) -> list[str]:
    names = []
    while event.cpu_parent is not None:
        event = event.cpu_parent
        names.append(event.name)
    return names


def _copy_ops(step) -> tuple[Counter, Counter]:
    """Copy operators on the compute thread while ``step`` runs: those the framework makes, and
    those the communication backend makes inside a collective or its wait (Gloo's own
    collectives copy inside; NCCL's do not). The 0-d conversions torch makes of Python scalars
    (``x / 2``) are left out: they are not copies of tensor data."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
    events = prof.events()
    compute = {e.thread for e in events if e.name == "aten::linear"}
    framework, backend = Counter(), Counter()
    for e in events:
        if e.thread not in compute or not (e.name in COPY_OPS or e.name.startswith("fsdp::")):
            continue
        if all(shape == [] for shape in e.input_shapes if shape is not None):
            continue
        above = _ancestors(e)
        if any(a.startswith("c10d::") or a == "raggedfsdp::wait" for a in above):
            backend[e.name] += 1
        else:
            framework[e.name] += 1
    return framework, backend


def _fwd_bwd(model, idx, targets):
    def step():
        model(idx, targets).backward()

    return step


def _zero_copy(rank: int, world: int) -> dict[str, tuple[Counter, Counter] | dict]:
    from torch.distributed.fsdp import fully_shard as fsdp2

    torch.manual_seed(0)
    base = OddModel()
    idx, targets = make_batches(1, 2 * world)[0]
    idx, targets = idx[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]
    out = {}
    plain = copy.deepcopy(base)
    _fwd_bwd(plain, idx, targets)()  # warm-up: first calls allocate differently
    out["plain"] = _copy_ops(_fwd_bwd(plain, idx, targets))
    for name, zero_copy, block in (
        ("zero_copy", True, None),
        ("zero_copy_whole", True, "whole"),
        ("copy_path", False, None),
    ):
        model = copy.deepcopy(base)
        rf.FSDPBackend(
            model,
            shard_policy=rf.RaggedShard(block_size=block),
            dbuffer_config=rf.DBufferConfig(zero_copy=zero_copy),
        )
        _fwd_bwd(model, idx, targets)()
        model.reset_stats()
        out[name] = _copy_ops(_fwd_bwd(model, idx, targets))
        out[f"{name}_stats"] = model.stats()
    model = copy.deepcopy(base)
    for block in model.blocks:
        fsdp2(block)
    fsdp2(model)
    _fwd_bwd(model, idx, targets)()
    out["fsdp2"] = _copy_ops(_fwd_bwd(model, idx, targets))
    return out


def test_zero_copy_profile(grid):
    """fp32: around the reduce-scatter the framework copies nothing. Around the all-gather, a
    parameter a rank holds whole is a view of its shard, so nothing is copied for it; only the
    rank's piece of a parameter that crosses a rank boundary is placed into its slot of the
    unsharded buffer (on NCCL the collective's kernel places the slot; Gloo's point-to-point
    transfers leave it to us): none at all when every parameter is whole on one rank, at most
    two pieces per all-gather (one at each end of the rank's slot) with element cuts. The backend
    copies nothing either. The FSDP2-style path and FSDP2 itself copy in and out (negative
    controls)."""
    for counts in grid_of(grid, _zero_copy):
        plain, _ = counts["plain"]
        for name in ("zero_copy", "zero_copy_whole"):
            framework, backend = counts[name]
            stats = counts[f"{name}_stats"]
            assert stats["all_gather_calls"] > 0 and stats["reduce_scatter_calls"] > 0
            assert framework - plain == Counter({"aten::copy_": stats["copies"]}), counts
            assert plain - framework == Counter(), counts
            assert sum(backend.values()) == 0, counts
        whole = counts["zero_copy_whole_stats"]
        assert whole["copies"] == 0 and whole["copy_bytes"] == 0, whole
        element = counts["zero_copy_stats"]
        assert 0 < element["copies"] <= 2 * element["all_gather_calls"], element
        assert element["copy_bytes"] < element["all_gather_bytes"] / 2, element
        copy_path, _ = counts["copy_path"]
        assert counts["copy_path_stats"]["copy_bytes"] > 2 * element["all_gather_bytes"]
        assert sum(copy_path.values()) > sum(counts["zero_copy"][0].values()), counts
        fsdp2_framework, fsdp2_backend = counts["fsdp2"]
        extra_fsdp2 = fsdp2_framework - plain
        assert any("chunk_cat" in k or "split_with_sizes_copy" in k for k in extra_fsdp2), counts
        assert sum(fsdp2_backend.values()) > 0, counts


def _memory(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = OddModel()
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for idx, targets in make_batches(2, 4 * world):
        b = idx.shape[0] // world
        opt.zero_grad()
        model(idx[rank * b : (rank + 1) * b], targets[rank * b : (rank + 1) * b]).backward()
        opt.step()
    stats = model.stats()
    units = []
    for module in model.modules():
        state = getattr(module, "_raggedfsdp_state", None)
        if state is not None:
            params = sum(b.full_numel * b.comm_dtype.itemsize for b in state.group.buckets)
            grads = sum(
                b.full_numel * b.comm_dtype.itemsize for b in state.group.buckets if b.requires_grad
            )
            units.append((state.is_root, params, grads))
    expected_persistent = sum(
        plan.shard_numel * 4 * (2 if name_trainable(plan) else 1) for plan in model.shard_plans()
    )
    return {
        "persistent": stats["persistent_bytes"],
        "expected_persistent": expected_persistent,
        "peak_unsharded": stats["peak_unsharded_bytes"],
        "root": sum(p + g for is_root, p, g in units if is_root),
        "largest_block": max(p + g for is_root, p, g in units if not is_root),
        "largest_grads": max(g for is_root, p, g in units if not is_root),
        "params_and_grads": sum(
            p.numel() * 4 * (2 if p.requires_grad else 1) for p in OddModel().parameters()
        ),
        "padding": stats["padding_numel"] * 4,
        "unsharded_now": stats["unsharded_bytes"],
    }


def name_trainable(plan) -> bool:
    return not plan.name.endswith("/frozen/0") and "/frozen/" not in plan.name


def test_memory_at_w4(grid):
    """Persistent bytes per rank are (params + grads) / W plus padding; unsharded memory (what
    the framework holds beyond that, pooled scratch included) peaks at the root unit plus two
    blocks (one computing, one prefetched; the gradients of the one still reducing fit in the
    prefetched one's gradient share) plus the reduce-scatter's receive buffer ((W-1)/W of a
    block's gradients on Gloo), and is all freed between steps."""
    for m in grid_of(grid, _memory):
        assert m["persistent"] == m["expected_persistent"]
        assert m["persistent"] * 4 <= m["params_and_grads"] + 2 * m["padding"]
        receive = m["largest_grads"] * 3 // 4
        assert m["peak_unsharded"] <= m["root"] + 2 * m["largest_block"] + receive
        assert m["peak_unsharded"] > m["root"] + 2 * m["largest_block"] - m["largest_grads"]
        assert m["unsharded_now"] == 0


def _traffic(rank: int, world: int) -> dict[str, dict[str, float] | dict[str, int]]:
    cfg = GPT_CONFIGS["gpt-small"]
    torch.manual_seed(0)
    model = GPT(cfg)
    rf.FSDPBackend(model)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    steps = {}
    for name in ("first", "second"):  # the first step records the unit order
        model.reset_stats()
        model(idx[:, :-1], idx[:, 1:]).backward()
        steps[name] = model.stats()
    units = {}
    for module_name, module in model.named_modules():
        state = getattr(module, "_raggedfsdp_state", None)
        if state is not None:
            buckets = state.group.buckets
            units[module_name or "<root>"] = (
                sum(b.shard_numel * b.comm_dtype.itemsize for b in buckets),
                sum(b.full_numel * b.comm_dtype.itemsize for b in buckets),
            )
    return {"steps": steps, "units": units, "layers": cfg.n_layer}


def test_collectives_per_step(grid):
    """Bytes moved per step, exactly: the root is gathered once (it stays unsharded through
    backward), each block twice except the one that runs forward last, which stays unsharded
    into backward (one all-gather fewer per step than FSDP2's defaults; in the first step the
    order is not known yet, so it is freed and gathered again: the negative control); every unit
    is reduce-scattered once."""
    for r in grid_of(grid, _traffic):
        layers, units = r["layers"], r["units"]
        shard = {name: s for name, (s, _) in units.items()}
        full = sum(f for _, f in units.values())
        last = f"blocks.{layers - 1}"
        gathered = shard["<root>"] + 2 * sum(shard[f"blocks.{i}"] for i in range(layers))
        second, first = r["steps"]["second"], r["steps"]["first"]
        assert second["all_gather_calls"] == 2 * layers
        assert second["all_gather_bytes"] == gathered - shard[last]
        assert first["all_gather_calls"] == 2 * layers + 1
        assert first["all_gather_bytes"] == gathered
        for step in (first, second):
            assert step["reduce_scatter_calls"] == layers + 1
            assert step["reduce_scatter_bytes"] == full
            assert step["unsharded_bytes"] == 0  # all freed (and the pool emptied) after backward


def _meta_init(rank: int, world: int) -> bool:
    cfg = GPT_CONFIGS["gpt-tiny"]
    torch.manual_seed(5)
    whole = GPT(cfg).state_dict()
    model = GPT(cfg, device="meta")
    rf.FSDPBackend(model, shard_policy=rf.RaggedShard(block_size=4))
    torch.manual_seed(5)
    init_sharded_(model, lambda name, t: init_parameter_(name, t, cfg))
    full = rf.full_state_dict(model)
    return full.keys() == whole.keys() and all(torch.equal(full[k], whole[k]) for k in whole)


def test_meta_model_materialised_as_if_whole(grid):
    assert all(grid_of(grid, _meta_init))


def _bad_input(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    errors: dict[str, Any] = {"rank": rank}

    def expect(name, fn):
        errors[name] = error_message(fn)

    model = OddModel()
    rf.fully_shard(model)
    expect("twice", lambda: rf.fully_shard(model))
    mesh = DeviceMesh("cpu", [0])
    expect("mesh", lambda: rf.fully_shard(OddModel(), mesh=mesh))
    odd = nn.Linear(3, 4)
    odd.weight = nn.Parameter(torch.randn(3, 4).t())
    expect("contiguous", lambda: rf.fully_shard(odd))
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    rf.fully_shard(tied[0])
    expect("tied_across_units", lambda: rf.fully_shard(tied[1]))
    expect(
        "policy_vs_planner",
        lambda: rf.fully_shard(
            OddModel(),
            shard_policy=rf.RaggedShard(block_size=4),
            planner=rf.StructAwarePlanner(shard_policy=rf.RaggedShard(block_size=8)),
        ),
    )
    return errors


def test_bad_input_errors_before_any_collective(grid):
    for errors in grid_of(grid, _bad_input):
        assert "applied to a module once" in errors["twice"] and "twice" in errors["twice"]
        if errors["rank"] == 1:  # a mesh of rank 0 only: rank 1 is not in it
            assert "rank 1 is not in the mesh" in errors["mesh"]
        assert "'weight'" in errors["contiguous"] and "not contiguous" in errors["contiguous"]
        assert "FSDP does not support non-contiguous parameters" in errors["contiguous"]
        tied = errors["tied_across_units"]
        assert "'weight'" in tied and "sharded already" in tied and "common parent" in tied
        assert "differs from the planner's policy" in errors["policy_vs_planner"]


def test_fully_shard_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        rf.fully_shard(nn.Linear(2, 2))


def _one_rank_fails(rank: int, world: int) -> str:
    model = OddModel()
    rf.FSDPBackend(model)
    idx, targets = make_batches(1, 2)[0]
    model(idx, targets).backward()  # a good step first: lazy init done on both ranks
    if rank == 1:
        return "raised before forward"
    start = time.monotonic()
    try:
        model(idx, targets).backward()
    except Exception as e:
        return f"error after {time.monotonic() - start:.1f}s: {type(e).__name__}"
    return "no error"


def test_failed_rank_does_not_hang_the_others():
    results = run_distributed(_one_rank_fails, 2, pg_timeout=5, timeout=120)
    assert results[1] == "raised before forward"
    assert results[0].startswith("error after"), results[0]


def _originals_freed(rank: int, world: int) -> tuple[int, int]:
    import gc
    import weakref

    model = OddModel()
    refs = [weakref.ref(p) for p in model.parameters()]
    rf.FSDPBackend(model)
    gc.collect()
    return sum(r() is not None for r in refs), len(refs)


def test_wrapping_frees_the_original_parameters(grid):
    """Only shards stay: nothing keeps the unsharded model's parameters alive after wrapping."""
    for alive, total in grid_of(grid, _originals_freed):
        assert (alive, total) == (0, 17)


#: The cases by world size, in one launch (the failing rank's case runs apart).
CASES_BY_WORLD = {
    2: (_zero_copy, _traffic, _bad_input, _originals_freed),
    3: (_meta_init,),
    4: (_memory,),
}


def _cases(rank: int, world: int, group: None) -> dict[str, Any]:
    return {case.__name__: case(rank, world) for case in CASES_BY_WORLD[world]}


grid = world_grid_fixture(_cases, list(CASES_BY_WORLD), as_launches=True, timeout=600)


def grid_of(grid: dict[int, list[dict[str, Any]]], case: Callable) -> list[Any]:
    """Every rank's result of ``case``, at the world size it runs at."""
    [world] = [w for w, cases in CASES_BY_WORLD.items() if case in cases]
    return [result[case.__name__] for result in grid[world]]
