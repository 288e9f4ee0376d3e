"""The job's guards: a NaN skip policy that gives up, strict-JSON metrics, and optional extras
that cost one line when missing. Real ``raggedfsdp train`` launches (gpt-tiny, 2 ranks); what is
refused before any launch runs the command in this process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launches import ENV, cli_command, run_cli
from raggedfsdp import cli

TINY = ["--model=gpt-tiny", "--batch-size=4", "--eval-batches=1", "--log-every=1"]


def _train(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_cli("train", *TINY, f"--out={out}", *args, env=env)


def _strict_records(out: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (a bare NaN or Infinity fails)."""

    def reject(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")

    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=reject) for line in lines]


def test_skip_policy_gives_up_and_metrics_stay_strict_json(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _train(
        out, "--steps=30", "--lr=1e6", "--on-nan=skip", "--max-consecutive-skips=3",
        "--checkpoint-every=0", "--eval-every=0",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raggedfsdp: error")]
    assert "3 steps in a row (--max-consecutive-skips); giving up" in errors[0]
    records = [r for r in _strict_records(out) if r["kind"] == "train"]
    assert records[-1]["skipped_steps"] == 3
    assert records[-1]["step"] < 30  # it stopped early
    assert "nan" in {r["grad_norm"] for r in records}  # non-finite values written as strings
    # The total limit too: never 3 in a row, but 2 skips in all is the limit here.
    proc = _train(
        tmp_path / "run2", "--steps=30", "--lr=1e6", "--on-nan=skip",
        "--max-skipped-steps=2", "--checkpoint-every=0", "--eval-every=0",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "2 steps in this launch (--max-skipped-steps)" in proc.stderr


def _in_this_process(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``raggedfsdp train`` with TINY and ``args`` in this process (a refusal before the launch
    needs no interpreter of its own): its status, and what this process or any it started wrote
    to stderr."""
    capfd.readouterr()
    status = cli.main(["train", *TINY, *args])
    return status, capfd.readouterr().err


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 3-step run of a plain install (no matplotlib, no tensorboard): here both modules are
    made unimportable for the workers too. Its folder and its launch."""
    tmp = tmp_path_factory.mktemp("plain")
    stubs = tmp / "stubs"
    stubs.mkdir()
    for name in ("matplotlib", "tensorboard"):
        (stubs / f"{name}.py").write_text(f'raise ImportError("No module named {name}")\n')
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(stubs), ENV.get("PYTHONPATH", "")])}
    out = tmp / "run"
    return {
        "out": out,
        "proc": _train(out, "--steps=3", "--tensorboard", "--checkpoint-every=0", env=env),
    }


def test_missing_report_extras_cost_one_line_each(plain_install: dict) -> None:
    """A plain install (no matplotlib, no tensorboard) trains, reports what it skipped and
    exits 0: here both modules are made unimportable for the workers too."""
    out, proc = plain_install["out"], plain_install["proc"]
    assert proc.returncode == 0, proc.stderr
    assert "report.png skipped: pip install 'raggedfsdp[report]' (matplotlib)" in proc.stdout
    assert "tensorboard skipped: pip install 'raggedfsdp[report]' (tensorboard)" in proc.stdout
    assert not (out / "report.png").exists()
    assert _strict_records(out)[-1]["kind"] == "eval"  # the run itself completed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--comm-timeout-s=inf"], "comm_timeout_s: must be a finite number of seconds, got inf"),
        (["--seed=100000000000000000000000"], "seed: must be in [0, 2**63)"),
        (["--block-size=7x3"], "block_size 7x3: parameter 'blocks.0.attn.q_proj.weight'"),
        (["--seq-len=64", "--data=DATA"], "the train split of DATA has 38 bytes, fewer than"),
    ],
    ids=["timeout", "seed", "block", "corpus"],
)
def test_refused_before_launch_leaving_out_untouched(tmp_path: Path, capfd, args, message) -> None:
    data = tmp_path / "tiny.txt"
    data.write_bytes(b"x" * 40)
    args = [a.replace("DATA", str(data)) for a in args]
    out = tmp_path / "run"
    status, err = _in_this_process(capfd, f"--out={out}", "--steps=2", *args)
    assert status == 2
    assert err.count("\n") == 1, err  # one line, no worker started
    assert message.replace("DATA", str(data)) in err
    assert not out.exists()


def test_resume_past_the_last_step_is_refused(plain_install: dict, tmp_path: Path, capfd) -> None:
    out = tmp_path / "run"
    # Judged by what the run left, not its exit status: Gloo may abort at exit (docs/design.md).
    shutil.copytree(plain_install["out"], out)
    assert (out / "checkpoints" / "step_000003" / "COMPLETE.json").is_file()
    status, err = _in_this_process(capfd, f"--out={out}", "--steps=2", "--resume")
    assert status == 2
    assert "is at step 3, not before --steps 2: nothing to train" in err


def _on_small_disk(size: str, command: list[str], mount: Path) -> subprocess.CompletedProcess:
    """``command`` with a tmpfs of ``size`` mounted at ``mount`` in a private mount namespace
    (a real full disk: root and ``unshare`` needed, as on this project's machines)."""
    script = f'mount -t tmpfs -o size={size} tmpfs {mount} && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )


@pytest.fixture
def small_disk(tmp_path: Path):
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    return mount


def _train_command(out: Path, *args: str) -> list[str]:
    return cli_command("train", *TINY, f"--out={out}", *args)


def test_too_small_a_disk_is_refused_before_launch(small_disk: Path) -> None:
    proc = _on_small_disk("600k", _train_command(small_disk / "run", "--steps=2"), small_disk)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    # 600 KiB less the page of the run-folder lock, taken before the check
    assert "has 596.0 KiB free, but one checkpoint of this run needs about" in proc.stderr


def test_disk_full_mid_run_is_one_line_and_keeps_the_last_checkpoint(small_disk: Path) -> None:
    """Room for one checkpoint of gpt-tiny (1.7 MiB) but not two: the second save fails."""
    check = (
        "import sys; from raggedfsdp.train.run_dir import verify_checkpoint;"
        "print(verify_checkpoint(sys.argv[1]))"
    )
    out = small_disk / "run"
    command = _train_command(out, "--steps=4", "--checkpoint-every=2", "--eval-every=0")
    script = [
        "sh",
        "-c",
        f"{' '.join(command)}; echo status=$?; {sys.executable} -c '{check}' "
        f"{out}/checkpoints/step_000002",
    ]
    proc = _on_small_disk("2600k", script, small_disk)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("raggedfsdp: error")]
    assert "status=1" in proc.stdout, proc.stderr
    assert errors and all("No space left on device" in e or "training failed" in e for e in errors)
    assert proc.stdout.strip().splitlines()[-1] == "None"  # step 2 verifies: intact
    assert "Traceback" not in proc.stderr
