"""Pipeline parallelism in the capacity model, pure: the bubble against the papers' formulas, the
micro-batches in flight against torch's own schedules (their ``pipeline_order``, built without
running anything), torchtitan's cut, Llama-3.1-405B's memory per stage against arithmetic done
here, the search's time, and ``raggedfsdp plan --pp``."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining.schedules import _ComputationType

import pipeline_cases
import raggedfsdp as rf
from raggedfsdp.capacity import CapacityOptions, hardware
from raggedfsdp.capacity.cost import unit_bytes
from raggedfsdp.capacity.pipeline import plan_pipeline, search_pipeline
from raggedfsdp.capacity.schedules import PipelineSchedule
from raggedfsdp.capacity.stages import stage_layers
from raggedfsdp.cli import main
from raggedfsdp.facts import PP_SCHEDULES, check_schedule, schedule_class, stages_per_rank
from raggedfsdp.models import build_model

GIB = 2**30


def _torch_order(name: str, pp: int, m: int, v: int) -> dict[int, list]:
    """torch's action order for every rank: the schedule built over stand-in stages (what its
    constructor reads: the stage count, the group's size and rank), nothing run."""
    cls = getattr(torch_schedules, schedule_class(name))
    stages = [
        SimpleNamespace(
            num_stages=pp * v, group_size=pp, group_rank=0, stage_index=k * pp, submod=None
        )
        for k in range(v)
    ]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, m, loss_fn=None)
    return schedule.pipeline_order


def _held(actions: list, *, until: tuple) -> int:
    """The most micro-batches forwarded and not yet through their last backward action
    (``until``: the action types that end one) in a rank's order."""
    held = most = 0
    for action in actions:
        if action is None:
            continue
        if action.computation_type == _ComputationType.FORWARD:
            held += 1
        elif action.computation_type in until:
            held -= 1
        most = max(most, held)
    return most


_LAST = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT)


def _torch_takes(name: str, pp: int, m: int) -> bool:
    """Whether torch's constructor takes ``m`` micro-batches over ``pp`` ranks."""
    if name == "1f1b":
        return m >= pp
    if name in ("interleaved-1f1b", "zero-bubble"):
        return m % max(1, m // pp) == 0
    return True


_CASES = [
    (name, pp, m, v)
    for name in PP_SCHEDULES
    for v in ((1,) if name in ("gpipe", "1f1b") else (1, 2, 3))
    for pp in (2, 3, 4, 8)
    for m in (1, 2, 3, 4, 6, 8, 12, 16)
    if _torch_takes(name, pp, m)
]


def test_in_flight_equals_a_count_over_torchs_action_order():
    """Every schedule, 1 to 3 stages per rank, 2 to 8 ranks, 1 to 16 micro-batches: the rule
    each schedule's in_flight states equals the count over torch's order, rank by rank."""
    for name, pp, m, v in _CASES:
        order = _torch_order(name, pp, m, v)
        schedule = PipelineSchedule(name, pp, m, v)
        got = [schedule.in_flight(r) for r in range(pp)]
        assert got == [_held(order[r], until=_LAST) for r in range(pp)], (name, pp, m, v)
    assert len(_CASES) > 150


def test_zero_bubbles_weight_backward_holds_activations():
    """Negative control: counting a zero-bubble micro-batch done at its input backward
    (BACKWARD_INPUT) undercounts where torch defers the weight backward (rank > 0)."""
    order = _torch_order("zero-bubble", 4, 8, 2)
    early = [_held(order[r], until=(_ComputationType.BACKWARD_INPUT,)) for r in range(4)]
    schedule = PipelineSchedule("zero-bubble", 4, 8, 2)
    assert early[0] == schedule.in_flight(0)
    assert all(early[r] < schedule.in_flight(r) for r in (1, 2, 3))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 32), (16, 16)])
def test_bubble_fractions_are_the_papers(pp, m):
    f, b, w = 1.0, 1.0, 1.0  # forward, input backward, weight backward of one micro-batch
    for name in ("gpipe", "1f1b"):
        assert PipelineSchedule(name, pp, m).bubble_fraction(f, b, w) == pytest.approx(
            (pp - 1) / (m + pp - 1)
        )
    for v in (2, 4):
        interleaved = PipelineSchedule("interleaved-1f1b", pp, m, v)
        assert interleaved.bubble_fraction(f, b, w) == pytest.approx(
            (pp - 1) / v / (m + (pp - 1) / v)
        )
        zero = PipelineSchedule("zero-bubble", pp, m, v)
        # ZB-H1: (p - 1)(F + B - W), a third of 1F1B's (p - 1)(F + B + W) when they are equal
        assert zero.bubble_s(f, b, w) == pytest.approx(interleaved.bubble_s(f, b, w) / 3)
        assert zero.bubble_fraction(f, b, w) == pytest.approx((pp - 1) / (3 * v * m + pp - 1))
    assert PipelineSchedule("zero-bubble", pp, m, 2).bubble_s(1.0, 0.5, 2.0) == 0.0


def test_schedule_refusals_are_torchs():
    with pytest.raises(ValueError, match=r"^microbatches: 1f1b over --pp 4 needs at least 4 micro"):
        PipelineSchedule("1f1b", 4, 3)
    with pytest.raises(ValueError, match=r"^microbatches: interleaved-1f1b runs its 9 .* 2 rounds"):
        PipelineSchedule("interleaved-1f1b", 4, 10 - 1, 2)
    with pytest.raises(ValueError, match=r"^stages_per_rank: gpipe runs one stage per rank, not 2"):
        PipelineSchedule("gpipe", 4, 4, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'dualpipe'"):
        PipelineSchedule("dualpipe", 4, 4)


def _refused(make) -> bool:
    try:
        make()
    except ValueError:
        return True
    return False


def test_the_facts_refuse_what_torchs_constructors_refuse():
    """``facts.check_schedule`` (the job's and the planner's one rule) against torch's own
    constructors, over 2 to 4 ranks and 1 to 12 micro-batches: refused exactly where torch
    refuses, and some of each."""
    verdicts = []
    for name in PP_SCHEDULES:
        v = stages_per_rank(name)
        for pp in (2, 3, 4):
            for m in range(1, 13):
                torch_refuses = _refused(lambda n=name, p=pp, k=m, s=v: _torch_order(n, p, k, s))
                ours = _refused(lambda n=name, p=pp, k=m, s=v: check_schedule(p, n, k, s))
                assert ours == torch_refuses, (name, pp, m)
                verdicts.append(ours)
    assert 0 < sum(verdicts) < len(verdicts)


def test_stages_are_cut_as_torchtitan_cuts_them():
    """``generate_llm_fqn_per_model_part`` with the embedding and the head a layer each."""
    assert [len(r) for r in stage_layers(126, 8)] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert [len(r) for r in stage_layers(32, 4)] == [8, 9, 8, 7]  # 34 = 9 + 9 + 8 + 8
    for layers, stages in ((126, 16), (80, 5), (3, 2), (61, 31)):
        cut = stage_layers(layers, stages)
        assert [i for r in cut for i in r] == list(range(layers))
    with pytest.raises(ValueError, match="use at most 64 stages"):
        stage_layers(126, 65)


@pytest.fixture(scope="module")
def llama405b():
    return build_model("llama3-405b", device="meta")


def _options(tp: int = 8) -> CapacityOptions:
    return CapacityOptions(
        batch=1,
        seq_len=8192,
        checkpointing=True,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        tp=tp,
    )


def test_405b_memory_per_stage_by_hand(llama405b):
    """torchtitan's layout (dp 8, tp 8, pp 8) with interleaved 1F1B over 32 micro-batches,
    counted here from the shapes: each rank's shards (fp32, over dp x tp = 64 ranks), its
    unsharded bf16 parameters and fp32-accumulated gradients (over tp), the checkpointed blocks'
    inputs of the micro-batches in flight (b s d / tp in bf16 per layer)."""
    plan = plan_pipeline(
        llama405b,
        512,
        hardware("h100"),
        _options(),
        PipelineSchedule("interleaved-1f1b", 8, 32, 2),
        model_name="llama3-405b",
    )["raggedfsdp"]
    assert plan.dims == (8, 8, 8, 1)
    layer = sum(p.numel() for p in llama405b.layers[0].parameters())
    head = llama405b.output.weight.numel() + llama405b.norm.weight.numel()
    emb = llama405b.tok_embeddings.weight.numel()
    for rank in plan.ranks:
        numel = rank.layers * layer + (emb if rank.embedding else 0) + (head if rank.head else 0)
        assert rank.params == pytest.approx(numel / 64 * 4, rel=2e-3)
        assert rank.unsharded == pytest.approx(numel / 8 * (2 + 4), rel=2e-3)
        per_layer = 8192 * 16384 // 8 * 2  # a checkpointed block keeps its input
        held = rank.in_flight / 2 * rank.layers * per_layer
        assert held < rank.activations < held + 3 * GIB  # and the backward's working set
    rank0 = plan.ranks[0]
    assert (rank0.layers, rank0.in_flight) == (15, 23)  # stages 0 (emb + 7) and 8 (8)
    # torchtitan measured 72.7 GiB (Float8, torch.compile, the allocator's reserve on top)
    assert 40 * GIB < plan.peak < 72.7 * GIB and plan.fits
    assert plan.bubble_fraction == pytest.approx(7 / 2 / (32 + 7 / 2), rel=0.02)


def test_405b_search_runs_under_ten_seconds(llama405b):
    """CPU seconds of this process, which the suite's other workers do not inflate (the wall
    clock on an idle machine: docs/results/capacity.md)."""
    start = time.process_time()
    search = search_pipeline(
        llama405b,
        512,
        hardware("h100"),
        _options(tp=1),
        schedule="interleaved-1f1b",
        microbatches=32,
        stages_per_rank=2,
        model_name="llama3-405b",
    )
    took = time.process_time() - start
    assert took < 10, took
    assert search.fastest is not None and search.tried >= 20
    layouts = {(f.dp, f.tp, f.pp, f.ep) for f in search.fits}
    assert (8, 8, 8, 1) in layouts  # torchtitan's
    assert all(f.dp * f.tp * f.pp == 512 for f in search.fits)


def test_stages_plan_as_the_pipeline_tests_cut_and_shard_them():
    """The decoder tests/distributed/test_pipeline.py runs (its layers in a ``ModuleDict``, as
    torchtitan's models hold them), cut by its own ``cut`` and planned as ``fully_shard`` on each
    layer and the stage plans it over dp = 2: the model's shards and whole-step unsharded bytes
    per rank equal that stage's plans'."""
    hw, options = hardware("cpu-gloo"), CapacityOptions(batch=2, seq_len=pipeline_cases.SEQ)
    model = pipeline_cases.Decoder()
    plan = plan_pipeline(model, 4, hw, options, PipelineSchedule("1f1b", 2, 4))["raggedfsdp"]
    for rank in plan.ranks:
        part = pipeline_cases.cut(model, rank.rank, 2)
        layers = set(part.layers.values())
        plans = rf.StructAwarePlanner().plan_model(part, 2, wrap=lambda m, ls=layers: m in ls)
        units = unit_bytes(plans)
        assert rank.params == sum(u.shard_numel for u in units) * 4
        whole = sum(u.storage_bytes(2, 4) + u.storage_bytes(2, 4, trainable=True) for u in units)
        assert rank.unsharded == whole
        assert (rank.layers, rank.embedding, rank.head) == (2, rank.rank == 0, rank.rank == 1)


def test_cut_refusals_name_the_fault():
    hw, options = hardware("h100"), CapacityOptions(batch=1, seq_len=64)
    tied = build_model("gpt-tiny", device="meta")
    with pytest.raises(ValueError, match="ties a weight"):
        plan_pipeline(tied, 4, hw, options, PipelineSchedule("1f1b", 2, 4))
    llama = build_model("llama3-8b", device="meta")
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        plan_pipeline(llama, 6, hw, options, PipelineSchedule("1f1b", 4, 4))


def test_plan_pp_command(capsys: pytest.CaptureFixture[str], tmp_path):
    args = ["plan", "--model", "llama3-8b", "--world", "16", "--gpu", "h100", "--seq", "4096"]
    assert main([*args, "--pp", "4", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    ours = record["systems"]["raggedfsdp"]
    assert ours["dims"] == [4, 1, 4, 1] and len(ours["ranks"]) == 4
    assert [r["in_flight"] for r in ours["ranks"]] == [4, 3, 2, 1]  # 1F1B, 16 micro-batches
    assert record["search"]["fastest"] is not None
    assert main([*args, "--pp", "4", "--pp-schedule", "zero-bubble"]) == 0
    out = capsys.readouterr().out
    assert "rank 3: 7 layers + head" in out and "fastest that fits" in out
    for extra, named in (
        (["--pp", "5"], "does not divide the world size 16"),
        (["--pp", "4", "--plot", str(tmp_path / "curve.png")], "does not take --pp"),
        (["--pp", "4", "--reshard-after-forward", "2"], "no reshard after forward"),
        (["--pp", "4", "--microbatches", "3"], "1f1b over --pp 4 needs at least 4 micro-batches"),
    ):
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and named in err, err
