"""``raggedfsdp plan`` in this process: output shape, figures checked by hand, one-line user
errors. (Through ``python -m raggedfsdp.cli``:
tests/e2e/test_commands_in_a_fresh_interpreter.py.)"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from raggedfsdp.capacity.report import fsdp1_unit_split, fsdp2_param_split, plan_report
from raggedfsdp.cli import main
from raggedfsdp.cli.plan import parse_world_sizes
from raggedfsdp.layout import parse_block_size
from raggedfsdp.models import build_model
from raggedfsdp.planner import StructAwarePlanner, parse_buffer_size

FIELDS = {
    "model",
    "optimizer",
    "block_size",
    "buffer_size",
    "dtype",
    "world_size",
    "buckets",
    "param_numel",
    "padding_numel",
    "padding_ratio",
    "rank_numel",
    "allgather_bytes_max",
    "allgather_bytes_total",
    "plan_seconds",
    "bound_rank_numel",
    "bound_padding_ratio",
    "bound_ratio",
    "worst_bound_ratio",
    "worst_bucket",
    "fsdp2_padding_numel",
    "fsdp2_padding_ratio",
    "fsdp2_cut_blocks",
    "fsdp1_padding_numel",
    "fsdp1_cut_blocks",
}


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    assert main(["plan", "--model", "gpt-tiny", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_one_object_per_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    records = run_json(capsys, "--world", "2,3")
    assert [r["world_size"] for r in records] == [2, 3]
    for r in records:
        assert set(r) >= FIELDS, FIELDS - set(r)
        assert r["model"] == "gpt-tiny" and r["optimizer"] == "adamw" and r["dtype"] == "float32"
        assert r["buckets"] == 3  # two blocks and the root
        assert r["plan_seconds"] >= 0


def test_gpt_tiny_figures_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-tiny (d=64, 2 layers, vocab 256, 64 positions, tied head) at W=3, element granularity.

    Per block: 4 LayerNorm vectors [64], q k v 3x[64,64], attn.proj [64,64], fc [256,64],
    mlp.proj [64,256] = 49,408 elements; root: tok_emb [256,64], pos_emb [64,64], ln_f 2x[64]
    = 20,608.
    """
    (r,) = run_json(capsys, "--world", "3")
    block, root = 4 * 64 + 3 * 64 * 64 + 64 * 64 + 256 * 64 + 64 * 256, 256 * 64 + 64 * 64 + 2 * 64
    assert (block, root) == (49408, 20608)
    assert r["param_numel"] == 2 * block + root
    assert r["param_numel"] == sum(p.numel() for p in build_model("gpt-tiny").parameters())

    # Ours: every numel is a multiple of the 4-element (16-byte) alignment, so each bucket's S is
    # ceil(total / 3) rounded up to 4: 16,472 per block, 6,872 for the root.
    assert r["rank_numel"] == 2 * 16472 + 6872
    assert r["padding_numel"] == 2 * (3 * 16472 - block) + (3 * 6872 - root) == 24

    # FSDP2 pads dim 0 to ceil(dim0/3)*3 rows: 64 -> 66 (+2 rows), 256 -> 258 (+2).
    per_block = 4 * 2 + 4 * 2 * 64 + 2 * 64 + 2 * 256  # norms, q k v attn.proj, fc, mlp.proj
    per_root = 2 * 64 + 2 * 64 + 2 * 2  # tok_emb, pos_emb, ln_f weight and bias
    assert r["fsdp2_padding_numel"] == 2 * per_block + per_root == 2580
    assert r["fsdp2_padding_ratio"] == pytest.approx(2580 / r["param_numel"])

    # FSDP1 pads each unit's flat parameter to a multiple of 3: +2 (49,410) per block, +2 root.
    assert r["fsdp1_padding_numel"] == 6


def test_cut_blocks_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """32-row blocks at W=3: FSDP2 gives ceil(dim0/3) rows per rank. Edges at 86 and 172 rows of
    256 (tok_emb, fc) and at 22 and 44 of 64 (pos_emb, projections, norms of 32-element blocks)
    each fall inside a different block: 2 cuts per parameter."""
    (r,) = run_json(capsys, "--world", "3", "--block-size", "32")
    per_block = 2 * (4 + 6)  # four norms, q k v, attn.proj, fc, mlp.proj
    per_root = 2 * 4  # tok_emb, pos_emb, ln_f weight and bias
    assert r["fsdp2_cut_blocks"] == 2 * per_block + per_root == 48
    assert r["worst_bound_ratio"] >= 1.0 and r["block_size"] == 32


def test_fsdp_split_helpers() -> None:
    # FSDP2: 10 rows of 3, unit 2 rows (6 elements), W=4 -> 3 rows (9 elements) per rank; edges at
    # elements 9, 18, 27 cut units 1 and 4 (18 is a unit edge).
    assert fsdp2_param_split((10, 3), 6, 4) == (9, 2)
    assert fsdp2_param_split((8, 3), 3, 4) == (6, 0)
    assert fsdp2_param_split((), 1, 4) == (1, 0)
    # FSDP1: [10 | 6] with units 5 and 3; W=4 -> chunk 4, edges 4, 8 (in the first), 12 (second).
    assert fsdp1_unit_split([10, 6], [5, 3], 4) == (4, 0, 3)
    assert fsdp1_unit_split([10, 6], [5, 3], 2) == (8, 0, 1)
    assert fsdp1_unit_split([10, 5], [5, 5], 3) == (5, 0, 0)


def _cuts_edge_by_edge(numels: list[int], units: list[int], chunk: int) -> int:
    """What the closed forms count, by visiting every split of a flat buffer (one per rank)."""
    starts = [sum(numels[:i]) for i in range(len(numels))]
    cut_units = set()
    for edge in range(chunk, sum(numels), chunk):
        i = max(i for i, s in enumerate(starts) if s <= edge and numels[i])
        local = edge - starts[i]
        if local % units[i]:
            cut_units.add((i, local // units[i]))
    return len(cut_units)


def test_fsdp_baselines_equal_counting_every_split() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        numels = [rng.choice([0, rng.randint(1, 60), rng.randint(1, 400)]) for _ in range(3)]
        units = [rng.choice([1, 2, 3, 7, 16, rng.randint(1, 50)]) for _ in range(3)]
        world = rng.randint(1, 300)
        chunk, _, cut = fsdp1_unit_split(numels, units, world)
        assert cut == (_cuts_edge_by_edge(numels, units, chunk) if chunk else 0)
        rows, row = rng.randint(1, 30), rng.randint(1, 5)
        per_rank, cut = fsdp2_param_split((rows, row), units[0], world)
        assert cut == _cuts_edge_by_edge([rows * row], units[:1], per_rank)


def test_any_world_size_answers_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """No loop runs over the ranks (it took minutes at W = 10**9): a billion ranks of
    Llama 3 8B cost what eight do."""
    module = build_model("llama3-8b", device="meta")
    started = time.perf_counter()
    (world,) = plan_report(module, [10**9], block_size=128).worlds
    assert time.perf_counter() - started < 5  # 0.06 s measured; minutes before
    # FSDP1 gives each rank an element of every unit and FSDP2 a row of every parameter (or
    # nothing): both cut every 128-row block.
    assert world.fsdp1_cut_blocks == world.fsdp2_cut_blocks == world.blocks_total
    (record,) = run_json(capsys, "--world", str(10**30))
    assert record["world_size"] == 10**30


def test_capacity_refuses_too_many_ranks_before_planning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned before refusing")

    monkeypatch.setattr(StructAwarePlanner, "plan_bucket", no_planning)
    assert main(["plan", "--model", "gpt-tiny", "--world", "1000000000", "--gpu", "h100"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "raggedfsdp: error: W=1,000,000,000 is more ranks than bucket 'blocks.0/float32/0' has "
        "blocks (49,408 under this block size): some rank would hold none of it. Use W <= "
        "49,408 or a smaller --block-size"
    ]


def test_report_of_a_module_in_bfloat16() -> None:
    report = plan_report(
        build_model("gpt-tiny"), [2], optimizer="muon", dtype=torch.bfloat16, model_name="tiny"
    )
    (w,) = report.worlds
    assert report.model == "tiny" and report.to_records()[0]["dtype"] == "bfloat16"
    assert w.allgather_bytes_total == 2 * w.rank_numel
    assert w.padding_numel == 2 * w.rank_numel - w.param_numel
    assert w.bound_ratio >= 1.0 and w.worst_bound_ratio >= 1.0


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt-tiny", "--world", "3", "--block-size", "128x64"]) == 0
    out = capsys.readouterr().out
    for text in ("gpt-tiny", "W=3", "raggedfsdp", "lower bound", "FSDP2", "FSDP1", "padding"):
        assert text in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--model", "no-such-model", "--world", "2"], "no-such-model"),
        (["--model", "gpt-tiny", "--world", "0"], "'0'"),
        (["--model", "gpt-tiny", "--world", "4,x"], "'x'"),
        (["--model", "gpt-tiny", "--world", "2", "--block-size", "32z"], "32z"),
        (["--model", "gpt-tiny", "--world", "2", "--block-size", "0"], "'0'"),
        (["--model", "gpt-tiny", "--world", "2", "--buffer-size", "-4"], "-4"),
        (["--model", "gpt-tiny", "--world", "2", "--optimizer", "sgdx"], "sgdx"),
        # A policy the shapes cannot meet: 48 columns do not divide the 64-element rows.
        (["--model", "gpt-tiny", "--world", "2", "--block-size", "32x48"], "48"),
    ],
)
def test_user_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("raggedfsdp: error: ") and named in lines[0]


def test_debug_shows_the_traceback() -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        main(["plan", "--debug", "--model", "no-such-model", "--world", "2"])
    with pytest.raises(ValueError, match="no-such-model"):
        main(["--debug", "plan", "--model", "no-such-model", "--world", "2"])


def test_help_and_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert "--block-size" in capsys.readouterr().out
    assert main([]) == 2
    assert "a command is needed" in capsys.readouterr().err


def test_value_parsers() -> None:
    assert parse_world_sizes("8, 64,8,1024") == (8, 64, 1024)
    assert parse_block_size("none") is None
    assert parse_block_size("whole") == "whole"
    assert parse_block_size("32") == 32
    assert parse_block_size("128x128") == (128, 128)
    assert parse_buffer_size("none") is None
    assert parse_buffer_size("4096") == 4096
    assert (
        parse_buffer_size("4MiB") == parse_buffer_size("4M") == parse_buffer_size("4mb") == 4 << 20
    )
    assert parse_buffer_size("1GiB") == 1 << 30
    for bad in ("", "x", "0", "-1", "4XB", "MiB"):
        with pytest.raises(ValueError, match="invalid buffer size"):
            parse_buffer_size(bad)
