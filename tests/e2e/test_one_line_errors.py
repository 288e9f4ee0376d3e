"""Every mistake the operations probe found is one line naming its cause, before any work where
it can be known there, with status 2 for a user's error (1 for the machine's: a full disk), and
leaves nothing behind: no ``--out`` folder, no partial file. Each test asserts the exact line.

In this process (``command``), but for a read-only and a full file system, which need a mount
namespace of their own (root and ``unshare``, as on this project's machines).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launches import ENV, cli_command
from raggedfsdp.models import GPT, GPT_CONFIGS
from raggedfsdp.train.checkpoints import save_checkpoint
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.job import _resume_notes
from raggedfsdp.train.run_dir import COMPLETE, checkpoint_files, resume_checkpoint

TINY = ["--model=gpt-tiny", "--batch-size=4"]


def _first_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.splitlines()[0]


# ---------------------------------------------------------------------------------------------
# export


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A gpt-tiny checkpoint written in this process (a group of one)."""
    out = tmp_path_factory.mktemp("run")
    model = GPT(GPT_CONFIGS["gpt-tiny"])
    optimizer = torch.optim.AdamW(model.parameters())
    meta = {"config": TrainConfig(model="gpt-tiny").to_dict(), "data": {"step": 2}, "job": "j"}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        return save_checkpoint(out, 2, model=model, optimizer=optimizer, meta=meta)


def test_export_checks_where_it_writes_first(command, checkpoint, tmp_path):
    def export(out: Path, *extra: str) -> tuple[int, str]:
        status, _, err = command("export", f"--checkpoint={checkpoint}", f"--out={out}", *extra)
        return status, err

    assert export(tmp_path) == (
        2,
        f"raggedfsdp: error: export: --out '{tmp_path}' is a folder; give a file name\n",
    )
    parent = tmp_path / "notes.txt"
    parent.write_text("mine")
    assert export(parent / "m.pt") == (
        2,
        f"raggedfsdp: error: export: --out '{parent}/m.pt': '{parent}' is a file, not a folder\n",
    )
    assert export(Path("/proc/m.pt")) == (
        2,
        "raggedfsdp: error: export: --out '/proc/m.pt': cannot write in '/proc' (No such file "
        "or directory)\n",
    )
    # A .safetensors name is written once, in that format; a file there is kept.
    tensors = tmp_path / "m.safetensors"
    assert export(tensors) == (0, "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "notes.txt"]
    assert export(tensors) == (
        2,
        f"raggedfsdp: error: export: '{tensors}' exists; pass --overwrite to replace it\n",
    )
    assert export(tensors, "--overwrite") == (0, "")


def _in_mount(options: str, command: list[str], mount: Path) -> subprocess.CompletedProcess:
    """``command`` with a tmpfs mounted (``options``) at ``mount``, in a private namespace;
    then the free bytes there, on the last line of stdout."""
    free = f"{sys.executable} -c 'import shutil; print(shutil.disk_usage(\"{mount}\").free)'"
    script = f'mount -t tmpfs -o {options} tmpfs {mount} && "$@"; {free}; ls -A {mount}'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and unshare to mount a tmpfs")
    where = tmp_path / "mnt"
    where.mkdir()
    return where


def test_export_to_a_read_only_or_full_file_system(checkpoint, mount):
    command = cli_command("export", f"--checkpoint={checkpoint}", f"--out={mount}/m.pt")
    read_only = _in_mount("ro,size=1m", command, mount)
    assert read_only.returncode == 0  # the listing's
    assert _first_line(read_only.stderr) == (
        f"raggedfsdp: error: export: --out '{mount}/m.pt': cannot write in '{mount}' (Read-only "
        f"file system)"
    )
    # Room for the torch.save file (480 KB) but not its .safetensors twin: neither is left.
    full = _in_mount("size=600k", command, mount)
    assert re.fullmatch(
        rf"raggedfsdp: error: cannot write '{mount}/m.safetensors': No space left on device "
        r"\([\d.,]+ (B|KiB) free\)",
        _first_line(full.stderr),
    ), full.stderr
    assert full.stderr.count("\n") == 1
    assert full.stdout.split()[-1] == str(600 * 1024)  # the listing is empty: all freed


# ---------------------------------------------------------------------------------------------
# plan and bench


def test_plan_plot_where_it_cannot_write(command, tmp_path):
    plan = ["plan", "--model=gpt-tiny", "--world=2", "--gpu=h100"]
    status, out, err = command(*plan, "--plot=/proc/capacity.png")
    assert (status, out) == (2, "")  # refused before planning: nothing printed
    assert err == (
        "raggedfsdp: error: --plot '/proc/capacity.png': cannot write in '/proc' (No such file or "
        "directory)\n"
    )
    status, _, err = command(*plan, f"--plot={tmp_path}")
    assert err == f"raggedfsdp: error: --plot '{tmp_path}' is a folder; give a file name\n"


def test_bench_link_rate_must_be_finite(command):
    status, _, err = command("bench", "--link-gbit=inf")
    assert (status, err) == (
        2,
        "raggedfsdp: error: --link-gbit must be a finite rate > 0, got inf\n",
    )


# ---------------------------------------------------------------------------------------------
# train: config files, Hugging Face configs, memory


def test_config_file_repeated_key_and_not_utf8(command, tmp_path):
    repeated = tmp_path / "repeated.toml"
    repeated.write_text("batch_size = 8\nbatch-size = 4\n")
    status, _, err = command("train", f"--config={repeated}")
    assert (status, err) == (
        2,
        f"raggedfsdp: error: config file '{repeated}': keys 'batch_size' and 'batch-size' both "
        f"set batch_size; keep one\n",
    )
    latin = tmp_path / "latin1.toml"
    latin.write_bytes("steps = 4  # café\n".encode("latin-1"))
    status, _, err = command("train", f"--config={latin}")
    assert err == (
        f"raggedfsdp: error: config file '{latin}' is not UTF-8 text, as TOML must be (byte 0xe9 "
        f"at offset 16)\n"
    )


_LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model_type": "llama", **_LAYERS, "num_attention_heads": 4, "hidden_size": -64},
            "hidden_size must be a positive integer, got -64",
        ),
        (
            {"model_type": "llama", **_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 3},
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3 (each key/value "
            "head serves a whole group of query heads)",
        ),
        (
            {"model_type": "llama", **_LAYERS, "num_attention_heads": 4,
             "max_position_embeddings": 0},
            "max_position_embeddings must be a positive integer, got 0",
        ),
        (
            {"model_type": "mixtral", **_LAYERS, "num_attention_heads": 4,
             "num_local_experts": -2},
            "num_local_experts must not be negative, got -2",
        ),
    ],
    ids=["negative-size", "kv-heads", "no-positions", "negative-experts"],
)  # fmt: skip
def test_hf_configs_that_describe_no_model(command, tmp_path, config, message):
    pytest.importorskip("transformers")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    status, _, err = command("train", f"--hf-config={folder}", f"--out={out}")
    assert (status, err) == (2, f"raggedfsdp: error: hf_config: '{folder}': {message}\n")
    assert not out.exists()


def test_a_tie_across_units_is_refused_before_launch(command, tmp_path):
    """BERT is a causal LM to transformers, but ties its embeddings (a unit of their own) to
    the root's decoder: the workers would refuse it after launch."""
    pytest.importorskip("transformers")
    folder = tmp_path / "bert"
    folder.mkdir()
    bert = {"model_type": "bert", **_LAYERS, "num_attention_heads": 4, "is_decoder": True}
    (folder / "config.json").write_text(json.dumps(bert))
    out = tmp_path / "run"
    status, _, err = command("train", f"--hf-config={folder}", f"--out={out}", "--seq-len=32")
    assert (status, err) == (
        2,
        f"raggedfsdp: error: hf_config: '{folder}': parameter 'cls.predictions.decoder.weight' "
        f"is tied to 'bert.embeddings.word_embeddings.weight' across FSDP units (the root and "
        f"bert.embeddings), but each unit shards its own parameters; untie them (a Hugging "
        f'Face config: "tie_word_embeddings": false)\n',
    )
    assert not out.exists()


def test_more_ranks_than_the_memory_holds(command, tmp_path):
    out = tmp_path / "run"
    status, _, err = command("train", *TINY, "--batch-size=1000", "--nproc=1000", f"--out={out}")
    assert status == 2
    assert re.fullmatch(
        r"raggedfsdp: error: memory: nothing is left for tensors: the available RAM, [\d.,]+ "
        r"GiB, shared by 1000 rank\(s\), less 256\.0 MiB per process; use fewer --nproc\n",
        err,
    ), err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# train --resume: what the checkpoints' records say


def _step_folder(out: Path, step: int, recorded: int | None) -> Path:
    """A hand-made checkpoint folder ``step_N`` whose ``COMPLETE.json`` records ``recorded``
    (None: it has none)."""
    path = out / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata")
    if recorded is not None:
        meta = {"step": recorded, "world_size": 2, "config": {}, "data": {"step": recorded}}
        (path / COMPLETE).write_text(json.dumps({**meta, "files": checkpoint_files(path)}))
    return path


def test_a_step_folder_that_records_another_step(command, tmp_path):
    out = tmp_path / "run"
    _step_folder(out, 10, 10)
    renamed = _step_folder(out, 30, 20)
    ckpt, line = resume_checkpoint(out, strict=False)
    assert ckpt == out / "checkpoints" / "step_000010"
    assert line == (
        "resume: skipped checkpoints/step_000030 (COMPLETE.json records step 20, not 30); "
        "resuming from checkpoints/step_000010"
    )
    status, _, err = command("train", *TINY, f"--out={out}", "--resume", "--strict-resume")
    assert (status, err) == (
        2,
        f"raggedfsdp: error: --strict-resume: checkpoint '{renamed}' does not verify "
        f"(COMPLETE.json records step 20, not 30); without --strict-resume the run falls back "
        f"to the newest one that does\n",
    )


def test_step_folders_without_their_records(command, tmp_path):
    """Every COMPLETE.json gone: --resume refuses rather than start over at step 0."""
    out = tmp_path / "run"
    old, new = _step_folder(out, 10, None), _step_folder(out, 20, None)
    status, _, err = command("train", *TINY, f"--out={out}", "--resume")
    assert (status, err) == (
        2,
        f"raggedfsdp: error: cannot resume: no checkpoint in '{out}' verifies: '{new}' could "
        f"not be read (it has no COMPLETE.json); '{old}' could not be read (it has no "
        f"COMPLETE.json); restore them, or move them away to start from step 0\n",
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # the lock went too


def test_resuming_without_error_feedback_says_the_residuals_are_dropped():
    saved = TrainConfig(compress_reduce_scatter="int8", error_feedback=True).to_dict()
    assert _resume_notes(saved, TrainConfig()) == [
        "saved with --error-feedback, resumed without: its error-feedback residuals are dropped"
    ]
    assert _resume_notes(saved, TrainConfig(**{**saved, "seed": 1})) == [
        "changed seed: the data order differs"
    ]
