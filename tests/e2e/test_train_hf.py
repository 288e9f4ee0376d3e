"""Hugging Face causal LMs in the training job: ``raggedfsdp train --hf-config`` and ``--compile``.

Tiny Llama (untied and tied) and a tiny Mixtral (MoE) each train 5 steps at W=2 through the real
launcher (torchrun's agent, Gloo, CPU): the losses equal those of one process on the global batch
(the worker run without torchrun: a group of one) to 1e-5; a run resumed from the step-3
checkpoint ends with the same parameters bit for bit (the tied Llama and the MoE); the exported
full state dict loads into a plain ``transformers`` model whose ``generate()`` works, whose
logits are those the model computes without a cache, and whose validation loss is the sharded
run's. The three single-process references share one interpreter (a launch costs seconds).
In this process, on a group of one: ``--compile`` equals eager without a compile per block (here,
not with the pure logic, for the compiler's minutes while its cache is cold). What needs no
launch (building, the one-line errors): tests/unit/test_train_hf_build_and_errors.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from launches import (
    ENV,
    assert_same_tensors,
    cli_command,
    metrics,
    ok,
    run_side_by_side,
    train_losses,
    workers_in_one_process,
)
from raggedfsdp import cli
from raggedfsdp.data import eval_batches, load_corpus
from raggedfsdp.models import hf
from raggedfsdp.train.build import build_model
from raggedfsdp.train.checkpoints import export_checkpoint
from raggedfsdp.train.config import TrainConfig

CASES = ("tiny-llama", "tiny-llama-tied", "tiny-mixtral")
# Resumed: the tied model (one parameter under two names) and the MoE (3-D expert tensors); the
# untied Llama has nothing they lack, and a launch costs ~10 s.
RESUMED = ("tiny-llama-tied", "tiny-mixtral")

# 5 steps of 8 sequences of 64 bytes; a checkpoint after step 3 to resume from; the end's
# evaluation and checkpoint (always made) for the exported model.
COMMON = [
    "--steps=5",
    "--batch-size=8",
    "--seq-len=64",
    "--warmup-steps=2",
    "--lr=1e-2",
    "--log-every=1",
    "--eval-every=0",
    "--eval-batches=2",
    "--checkpoint-every=3",
]


def _val_loss(out: Path) -> float:
    return metrics(out, "eval")[-1]["val_loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> dict[str, dict[str, Any]]:
    """Per case: the W=2 run, the single-process run, and (:data:`RESUMED`) the W=2 run resumed
    from its step-3 checkpoint."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    found: dict[str, dict[str, Any]] = {}
    for name in CASES:
        found[name] = {k: root / name / k for k in ("w2", "w1", "resumed")}
    # The worker without torchrun is a group of one: the three references in one interpreter.
    argvs = [
        [f"--hf-config={name}", *COMMON, f"--data={corpus}", f"--out={found[name]['w1']}"]
        for name in CASES
    ]
    # The launches and the references are independent: side by side, their waits overlap.
    for proc in run_side_by_side(
        *(
            cli_command(
                "train",
                f"--hf-config={name}",
                *COMMON,
                f"--data={corpus}",
                f"--out={found[name]['w2']}",
            )
            for name in CASES
        ),
        workers_in_one_process(*argvs),
    ):
        ok(proc)
    for name in RESUMED:
        step3 = found[name]["w2"] / "checkpoints" / "step_000003"
        shutil.copytree(step3, found[name]["resumed"] / "checkpoints" / "step_000003")
    resumes = (
        cli_command(
            "train",
            f"--hf-config={name}",
            *COMMON,
            f"--data={corpus}",
            f"--out={found[name]['resumed']}",
            "--resume",
        )
        for name in RESUMED
    )
    for proc in run_side_by_side(*resumes):
        ok(proc)
    return found


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_match_one_process(runs, name):
    w2, w1 = train_losses(runs[name]["w2"]), train_losses(runs[name]["w1"])
    assert sorted(w2) == [1, 2, 3, 4, 5]
    assert w2[5] < w2[1] - 0.5  # it trains
    for step in w2:
        assert abs(w2[step] - w1[step]) <= 1e-5, (step, w2[step], w1[step])


@pytest.mark.parametrize("name", RESUMED)
def test_resume_is_bit_exact(runs, name, tmp_path):
    assert train_losses(runs[name]["resumed"]) == {
        k: v for k, v in train_losses(runs[name]["w2"]).items() if k > 3
    }
    export_checkpoint(runs[name]["w2"], tmp_path / "full.pt")
    export_checkpoint(runs[name]["resumed"], tmp_path / "resumed.pt")
    assert_same_tensors(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "full.pt"))


@pytest.mark.parametrize("name", CASES)
def test_generate_after_loading_the_export(runs, name, corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    status = cli.main(
        ["export", "--checkpoint", str(runs[name]["w2"]), "--out", str(tmp_path / "m.pt")]
    )
    assert status == 0
    state = torch.load(tmp_path / "m.pt")
    model = transformers.AutoModelForCausalLM.from_config(hf.hf_config(name))
    model.load_state_dict(state, strict=True)
    model.eval()
    if name == "tiny-llama-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # The sharded run's validation loss, from the unsharded model on the same batches.
    val = load_corpus(corpus, seed=0).val
    batches = eval_batches(val, 2, seq_len=64, global_batch=8, seed=0)
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
            for x, y in batches
        ]
    assert abs(torch.stack(losses).mean().item() - _val_loss(runs[name]["w2"])) <= 1e-5
    # generate() with its cache: each new token's logits are the model's without one.
    prompt = batches[0][0][:2, :16]
    out = model.generate(
        prompt,
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert out.sequences.shape == (2, 22)
    with torch.no_grad():
        full = model(input_ids=out.sequences, use_cache=False).logits
    for i, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, 15 + i], atol=1e-5, rtol=1e-5)
        assert torch.equal(out.sequences[:, 16 + i], logits.argmax(-1))


# ---------------------------------------------------------------------------------------------
# --compile, in this process on a group of one.


def test_compile_matches_eager_without_recompiling(group_of_one, corpus):
    pytest.importorskip("transformers")
    import torch._dynamo

    for model_args in ({"model": "gpt-tiny"}, {"hf_config": "tiny-llama-tied"}):
        x, y = eval_batches(load_corpus(corpus, seed=0).val, 1, seq_len=32, global_batch=2, seed=0)[
            0
        ]
        losses = []
        for compiled in (False, True):
            cfg = TrainConfig(**model_args, compile=compiled, activation_checkpointing=True)
            model = build_model(cfg, torch.device("cpu"))
            loss = model(x, y)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            losses.append((loss.item(), grads))
        torch.testing.assert_close(losses[1][0], losses[0][0], atol=1e-5, rtol=1e-5)
        for got, want in zip(losses[1][1], losses[0][1], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch._dynamo.reset()
    # Blocks of one class share compiled code: a second block recompiling would raise here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        cfg = TrainConfig(hf_config="tiny-llama", compile=True)
        build_model(cfg, torch.device("cpu"))(x, y).backward()
    torch._dynamo.reset()


def test_export_needs_no_file_outside_the_checkpoint(corpus, tmp_path):
    """Trained from a relative path to a config.json, the checkpoint carries the config: it
    exports from another folder after the file is gone, as the model the run trained."""
    transformers = pytest.importorskip("transformers")
    work = tmp_path / "work"
    transformers.AutoConfig.for_model(**hf.TINY_CONFIGS["tiny-llama"]).save_pretrained(
        work / "my-llama"
    )
    argv = ["--hf-config=my-llama", "--steps=2", "--batch-size=4", "--seq-len=32",
            "--checkpoint-every=2", "--eval-every=0", f"--data={corpus}", "--out=run"]  # fmt: skip
    code = (
        "import json, sys\nfrom raggedfsdp.train import main\n"
        "sys.exit(main(json.loads(sys.argv[1])))"
    )
    ok(subprocess.run([sys.executable, "-c", code, json.dumps(argv)], cwd=work,
                      capture_output=True, text=True, env=ENV, timeout=180))  # fmt: skip
    shutil.rmtree(work / "my-llama")
    [written, *_] = export_checkpoint(work / "run", tmp_path / "exported.pt")
    state = torch.load(written)
    model = transformers.AutoModelForCausalLM.from_config(hf.hf_config("tiny-llama"))
    model.load_state_dict(state, strict=True)
