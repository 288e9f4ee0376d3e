"""A vision-language model in the training job: ``raggedfsdp train --hf-config tiny-llava``.

Six steps at W=2 through the real launcher (Gloo, CPU) on digits mixed with text, drawn per row,
so that in step 1 rank 1 has no image (its vision tower does not run) and rank 0 four: every
step's loss, the validation loss and the held-out digit accuracy equal those of one process on
the global batch (the worker without torchrun) to 1e-5; the summary and ``metrics.jsonl`` carry
the accuracy and ``report.png`` is drawn; a run resumed from the step-3 checkpoint ends with the
same parameters bit for bit; the exported state dict loads into transformers' own
``LlavaForConditionalGeneration``. (Building, the data, the one-line errors, in this process:
tests/unit/test_vlm.py.)
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from launches import (
    assert_same_tensors,
    cli_command,
    metrics,
    ok,
    run_side_by_side,
    train_losses,
    workers_in_one_process,
)
from raggedfsdp.data import load_corpus
from raggedfsdp.digits import ImageTextSampler, load_digits
from raggedfsdp.models import hf
from raggedfsdp.train.checkpoints import export_checkpoint
from raggedfsdp.train.run_dir import COMPLETE

pytest.importorskip("transformers")
pytest.importorskip("sklearn")

COMMON = [
    "--hf-config=tiny-llava",
    "--steps=6",
    "--batch-size=8",
    "--warmup-steps=2",
    "--lr=1e-2",
    "--log-every=1",
    "--eval-every=3",
    "--eval-batches=2",
    "--checkpoint-every=3",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, Path]:
    """The W=2 run (its console output beside it), the single-process run, and the W=2 run
    resumed from its step-3 checkpoint, started as soon as that checkpoint is complete (beside
    the others' last steps)."""
    root = tmp_path_factory.mktemp("vlm")
    found = {k: root / k for k in ("w2", "w1", "resumed")}
    data = f"--data={corpus}"
    step3 = found["w2"] / "checkpoints" / "step_000003"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            run_side_by_side,
            cli_command("train", *COMMON, data, f"--out={found['w2']}"),
            workers_in_one_process([*COMMON, data, f"--out={found['w1']}"]),
        )
        # Bounded by run_side_by_side's own timeout, after which the runs are done.
        while not ((step3 / COMPLETE).exists() or first.done()):
            time.sleep(0.05)
        if not (step3 / COMPLETE).exists():  # the W=2 run ended without it: say how
            ok(first.result()[0])
            pytest.fail("the W=2 run saved no step-3 checkpoint")
        shutil.copytree(step3, found["resumed"] / "checkpoints" / "step_000003")
        (resumed,) = run_side_by_side(
            cli_command("train", *COMMON, data, f"--out={found['resumed']}", "--resume")
        )
        w2, _ = first.result()
    ok(w2)
    (root / "w2.stdout").write_text(w2.stdout)
    ok(resumed)
    return found


def test_two_ranks_match_one_process(runs, corpus):
    # What the runs cover: a step in which one rank has images and the other none.
    fmt = hf.image_format("tiny-llava")
    digits, _ = load_digits()
    tokens = load_corpus(corpus, seed=0).train
    has = [
        [
            bool((x == fmt.prefix[0]).any())
            for x, _, _ in (
                ImageTextSampler(
                    tokens, digits, fmt, seq_len=64, global_batch=8, seed=0, rank=rank,
                    world_size=2, image_fraction=0.5,
                ).batch(step)
                for step in range(6)
            )
        ]
        for rank in range(2)
    ]  # fmt: skip
    assert any(a != b for a, b in zip(*has, strict=True)), has
    w2, w1 = train_losses(runs["w2"]), train_losses(runs["w1"])
    assert sorted(w2) == [1, 2, 3, 4, 5, 6]
    assert w2[6] < w2[1] - 0.5  # it trains
    for step in w2:
        assert abs(w2[step] - w1[step]) <= 1e-5, (step, w2[step], w1[step])
    evals2, evals1 = metrics(runs["w2"], "eval"), metrics(runs["w1"], "eval")
    assert [r["step"] for r in evals2] == [0, 3, 6]
    for got, want in zip(evals2, evals1, strict=True):
        assert abs(got["val_loss"] - want["val_loss"]) <= 1e-5
        # The same held-out digits, scored from rank-split batches: the same count right.
        assert got["digit_accuracy"] == pytest.approx(want["digit_accuracy"], abs=1e-9)
        assert 0.0 <= got["digit_accuracy"] <= 1.0


def test_summary_and_report(runs):
    stdout = (runs["w2"].parent / "w2.stdout").read_text()
    assert "held-out digit accuracy" in stdout and "(chance 10%)" in stdout
    pytest.importorskip("matplotlib")
    assert (runs["w2"] / "report.png").stat().st_size > 10_000


def test_resume_is_bit_exact_and_the_export_loads_into_transformers(runs, tmp_path):
    import transformers

    assert train_losses(runs["resumed"]) == {
        k: v for k, v in train_losses(runs["w2"]).items() if k > 3
    }
    export_checkpoint(runs["w2"], tmp_path / "full.pt")
    export_checkpoint(runs["resumed"], tmp_path / "resumed.pt")
    state = torch.load(tmp_path / "full.pt")
    assert_same_tensors(torch.load(tmp_path / "resumed.pt"), state)
    model = transformers.LlavaForConditionalGeneration(hf.hf_config("tiny-llava"))
    model.load_state_dict(state, strict=True)
