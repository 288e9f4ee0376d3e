"""``raggedfsdp train`` before any launch, in this process: a config file then the command line,
``--help`` and ``--dry-run``, and bad input as one line on stderr, a non-zero status, no
traceback (but with ``--debug``) and nothing overwritten. (What real launches do:
tests/e2e/test_train.py.)"""

from __future__ import annotations

import pytest

from launches import one_error_line
from raggedfsdp.train import build_parser
from raggedfsdp.train.config import config_from_args, load_toml, train_argv


def test_bad_data_paths(command, tmp_path):
    status, _, err = command(
        "train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")
    )
    assert status != 0
    one_error_line(err, "does not exist", "missing")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    status, _, err = command("train", "--data", str(empty), "--out", str(tmp_path / "o"))
    assert status != 0
    one_error_line(err, "is empty")


def test_bad_config_files(command, tmp_path):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('model = "gpt-tiny"\nbogus_option = 3\n')
    status, _, err = command("train", "--config", str(unknown))
    assert status != 0
    one_error_line(err, "unknown key 'bogus_option'")
    mistyped = tmp_path / "mistyped.toml"
    mistyped.write_text('steps = "many"\n')
    status, _, err = command("train", "--config", str(mistyped))
    assert status != 0
    one_error_line(err, "'steps'", "integer")
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = \n")
    status, _, err = command("train", "--config", str(broken))
    one_error_line(err, "not valid TOML")


def test_batch_must_divide(command, tmp_path):
    status, _, err = command(
        "train", "--batch-size", "6", "--grad-accum", "2", "--out", str(tmp_path)
    )
    assert status != 0
    one_error_line(err, "batch_size", "6", "2 rank(s) x 2 micro-batch(es)")


def test_non_empty_out_is_refused_and_kept(command, tmp_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    status, _, err = command("train", "--data", str(corpus), "--out", str(out))
    assert status != 0
    one_error_line(err, "not empty", "--resume", "--overwrite")
    status, _, err = command("train", "--data", str(corpus), "--out", str(out), "--overwrite")
    assert status != 0
    one_error_line(err, "--overwrite refused", "notes.txt")
    assert (out / "notes.txt").read_text() == "mine"


def test_debug_shows_the_traceback(command, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        command("train", "--debug", "--data", str(tmp_path / "missing"))


def test_config_file_then_command_line(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "gpt-tiny"\nsteps = 7\nlr = 1\nblock-size = "128x128"\n')
    assert load_toml(config) == {
        "model": "gpt-tiny",
        "steps": 7,
        "lr": 1.0,
        "block_size": "128x128",
    }
    args = build_parser().parse_args(["--config", str(config), "--steps", "9", "--no-tensorboard"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.steps, cfg.lr, cfg.block_size, cfg.tensorboard) == (
        "gpt-tiny",
        9,
        1.0,
        "128x128",
        False,
    )
    again = config_from_args(build_parser().parse_args(train_argv(args)))
    assert again == cfg  # what a launcher hands the workers means the same


def test_help_and_dry_run(command):
    status, out, _ = command("train", "--help")
    assert status == 0 and "--batch-size" in out and "--max-restarts" in out
    assert "--inject-fault" in out  # rehearsing recovery is a documented option
    status, out, err = command(
        "train", "--dry-run", "--model=gpt-small", "--nproc=4", "--block-size=32"
    )
    assert status == 0, err
    assert "4 rank(s)" in out and "estimated memory per rank" in out and "padding" in out
