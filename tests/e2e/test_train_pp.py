"""``raggedfsdp train --pp 2``: the GPT cut into two pipeline stages, each sharded over two data
ranks, in a real launch (torchrun's agent, 4 Gloo ranks, CPU), and its checkpoint resumed without
the pipeline.

gpt-tiny at (pp=2, dp=2) under 1F1B, 2 micro-batches, 5 AdamW steps, clipped: its head is tied to
its embedding across the stages. Beside it, one process on the global batch (the reference every
data-parallel run of the job agrees with to 1e-5). The losses agree to 1e-5 at every step. The
step-3 checkpoint resumes as the non-PP job at W=2 (dp=2) and finishes with the pipeline's losses;
every record holds each stage's step time and bubble fraction. Bad options are one line before
launch (more, and the stages' cut: tests/unit/test_train_pipeline_options.py).
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from launches import (
    FIVE_STEPS,
    cli_command,
    metrics,
    ok,
    one_error_line,
    run_side_by_side,
    train_losses,
    workers_in_one_process,
)

COMMON = ["--model=gpt-tiny", *FIVE_STEPS]
PIPELINE = ["--pp=2", "--pp-schedule=1f1b", "--microbatches=2"]
#: Options refused before launch, and what their one line names.
BAD = {
    "pp=3 on 4 ranks": (["--pp=3"], "pp=3 x ep=1 = 3 does not divide the world size 4"),
    "1 micro-batch, 2 stages": (["--pp=2", "--microbatches=1"], "needs at least 2 micro-batches"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Any]:
    """The pipeline run (``pp``, with its console output), one process on the global batch
    (``one``), the non-PP resumption at W=2 (``resumed``), and the refused launches."""
    root = tmp_path_factory.mktemp("pp")
    found: dict[str, Any] = {k: root / k for k in ("pp", "one", "resumed")}
    data = f"--data={corpus}"
    bad = [  # each its own folder: a launcher holds its folder's lock while it checks
        cli_command("train", "--nproc=4", *COMMON, *extra, data, f"--out={root / f'bad{i}'}")
        for i, (extra, _) in enumerate(BAD.values())
    ]
    procs = run_side_by_side(
        cli_command("train", "--nproc=4", *PIPELINE, *COMMON, data, f"--out={found['pp']}"),
        workers_in_one_process([*COMMON, data, f"--out={found['one']}"]),
        *bad,
    )
    found["console"] = ok(procs[0]).stdout
    ok(procs[1])
    found["bad"] = procs[2:]
    step3 = found["pp"] / "checkpoints" / "step_000003"
    shutil.copytree(step3, found["resumed"] / "checkpoints" / "step_000003")
    (resumed,) = run_side_by_side(
        cli_command("train", "--nproc=2", *COMMON, data, f"--out={found['resumed']}", "--resume")
    )
    found["resumed_console"] = ok(resumed).stdout
    return found


def test_the_pipeline_trains_as_one_process(runs):
    pp, one = train_losses(runs["pp"]), train_losses(runs["one"])
    assert sorted(pp) == [1, 2, 3, 4, 5]
    assert pp[5] < pp[1] - 0.3  # it trains
    for step in pp:
        assert abs(pp[step] - one[step]) <= 1e-5, (step, pp[step], one[step])
    assert "4 rank(s) (gloo, pp=2 x dp=2)" in runs["console"]


def test_each_stage_reports_its_bubble(runs):
    """Every record holds both stages, their step time and measured bubble (the schedule's
    step less the stage's compute, over the step time: some, never all), the loss beside the
    last stage; the summary names each stage's bubble."""
    for record in metrics(runs["pp"], "train"):
        stages = record["stages"]
        assert [s["stages"] for s in stages] == [[0], [1]]
        for stage in stages:
            assert 0 < stage["bubble_fraction"] < 1 and stage["step_s"] > 0, stage
        assert "loss" not in stages[0] and stages[1]["loss"] == record["loss"]
    assert "pipeline bubble (median)" in runs["console"]
    assert "stage 0: " in runs["console"] and "stage 1: " in runs["console"]


def test_the_checkpoint_resumes_without_the_pipeline(runs):
    """Saved at (pp=2, dp=2) under the whole model's names, loaded by the non-PP job at W=2:
    it continues with the pipeline's losses."""
    meta = json.loads((runs["pp"] / "checkpoints" / "step_000003" / "COMPLETE.json").read_text())
    assert meta["mesh"] == {"pp": 2, "dp": 2}
    resumed, pp = train_losses(runs["resumed"]), train_losses(runs["pp"])
    assert sorted(resumed) == [4, 5]
    for step in resumed:
        assert abs(resumed[step] - pp[step]) <= 1e-5, (step, resumed[step], pp[step])
    assert "saved on 4 rank(s) (pp=2 x dp=2), now 2)" in runs["resumed_console"]


@pytest.mark.parametrize("case", BAD)
def test_bad_options_are_one_line_before_launch(runs, case):
    proc = runs["bad"][list(BAD).index(case)]
    assert proc.returncode == 2
    one_error_line(proc.stderr, BAD[case][1])
