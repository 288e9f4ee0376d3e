"""``raggedfsdp bench`` end to end on gpt-tiny, W=2 (real Gloo processes, one launch per phase)."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from raggedfsdp.bench import run_bench
from raggedfsdp.cli import bench as bench_command

# FSDP2's copies around its collectives, each under any of its names: torch 2.15 packs the
# reduce-scatter input with aten's _chunk_cat where earlier versions call fsdp::chunk_cat.
FSDP2_COPY_OPS = (
    ("fsdp::all_gather_copy_in",),
    ("fsdp::split_with_sizes_copy",),
    ("fsdp::chunk_cat", "aten::_chunk_cat"),
)


def test_bench_gpt_tiny_reports_fewer_copies_than_fsdp2():
    parser = argparse.ArgumentParser()
    bench_command.configure(parser)
    argv = ["--model", "gpt-tiny", "--world", "2", "--warmup", "1", "--steps", "2"]
    args = parser.parse_args([*argv, "--systems", "fsdp2,raggedfsdp"])
    results = run_bench(bench_command.options_from_args(args))
    json.dumps(results)  # JSON-ready

    systems = results["systems"]
    assert list(systems) == ["raggedfsdp", "fsdp2"]  # report order, whatever the flag's order
    assert results["environment"]["backend"] == "gloo"
    assert results["environment"]["threads_per_rank"] == 1
    for entry in systems.values():
        assert len(entry["step_times_s"]) == 2 and len(entry["warmup_times_s"]) == 1
        assert entry["step_s"] > 0 and entry["vs_floor"] is None  # the floor was not run
        assert set(entry["phases_s"]) == {"fwd", "bwd", "opt"}
        assert {"total", "framework", "backend", "optimizer", "ops"} <= set(entry["copies"])
        for kind in ("all_gather", "reduce_scatter"):
            assert entry["collectives"][kind]["calls"] > 0
            assert entry["collectives"][kind]["bytes"] > 0
        memory = entry["memory"]
        assert len(memory["per_rank"]) == 2
        assert 0 < memory["max_tensor_at_step_start_bytes"] <= memory["max_tensor_peak_bytes"]
        assert memory["max_peak_rss_bytes"] > 0
    ours, fsdp2 = systems["raggedfsdp"], systems["fsdp2"]
    assert fsdp2["vs_fsdp2"] == pytest.approx(1.0)
    # Same model, seed and data: the first losses agree (the systems train the same thing).
    assert ours["losses_rank0"][0] == pytest.approx(fsdp2["losses_rank0"][0], rel=1e-5)
    # The profiler's view of raggedfsdp's collectives matches the runtime's own counters.
    stats = ours["runtime_stats"]
    assert ours["collectives"]["all_gather"]["bytes"] == stats["all_gather_bytes"]
    assert ours["collectives"]["reduce_scatter"]["bytes"] == stats["reduce_scatter_bytes"]
    # FSDP2 copies in and out of its collectives; zero copy does not.
    for names in FSDP2_COPY_OPS:
        assert sum(fsdp2["copies"]["ops"].get(op, 0) for op in names) > 0, names
        assert sum(ours["copies"]["ops"].get(op, 0) for op in names) == 0, names
    assert ours["copies"]["total"] < fsdp2["copies"]["total"]
    assert ours["copies"]["framework"] < fsdp2["copies"]["framework"]
    assert set(results["targets"]) == {"step_ratio", "peak_memory"}

    out = io.StringIO()
    bench_command.render(results, out)
    assert "raggedfsdp" in out.getvalue() and "FSDP2" in out.getvalue()
    assert "| raggedfsdp |" in bench_command.render_markdown(results)
