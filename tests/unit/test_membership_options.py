"""Elastic membership without launching anything: the options a launcher refuses in one line,
the torchrun command line they make, the shared store refused over restarting nodes, a
rendezvous store on a taken port, and the one line that names a failed worker and its cause.
(The membership changes themselves, with real torchrun agents: tests/e2e/test_elastic.py.)"""

from __future__ import annotations

import argparse
import socket
from datetime import timedelta

import pytest

from raggedfsdp import cli
from raggedfsdp.cli.train import configure as configure_train_parser
from raggedfsdp.cli.train import launch_options
from raggedfsdp.train import health
from raggedfsdp.train.config import TrainConfig
from raggedfsdp.train.launch import torchrun_argv


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--nnodes=2:1"], "expected N or MIN:MAX"),
        (["--nnodes=1:2", "--rdzv-endpoint=127.0.0.1:1"], "needs --max-restarts"),
        (["--nnodes=1:2", "--max-restarts=1"], "needs --rdzv-endpoint"),
        (["--rdzv-conf=join_timeout=soon", "--rdzv-endpoint=h:1"], "whole seconds"),
        (["--nnodes=2", "--rdzv-endpoint=127.0.0.1:1"], "needs --rdzv-id"),
    ],
)
def test_bad_membership_options_are_one_line(args, fragment, tmp_path, capsys):
    status = cli.main(["train", "--model=gpt-tiny", f"--out={tmp_path / 'run'}", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "run").exists()


def test_torchrun_gets_the_range_and_the_join_timeout():
    parser = argparse.ArgumentParser()
    configure_train_parser(parser)
    args = parser.parse_args(
        ["--nnodes=1:3", "--rdzv-endpoint=h:1", "--rdzv-id=j", "--rdzv-conf=a=b"]
    )
    argv = torchrun_argv(launch_options(args), [], cfg=TrainConfig(startup_timeout_s=42.5))
    assert "--nnodes=1:3" in argv and "--rdzv-conf=a=b,join_timeout=43" in argv


def test_shared_store_over_several_restarting_nodes_is_refused(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        health.attempt_store(timedelta(seconds=1))
    # Without restarts every node's count stays 0: allowed (here it reaches the TCPStore, and
    # fails to connect to a port nobody serves).
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    with pytest.raises(RuntimeError):
        health.attempt_store(timedelta(seconds=1))


def test_a_rendezvous_store_on_a_taken_port_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["rendezvous", f"--port={port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raggedfsdp: error: --port {port}: cannot listen")
    assert "address already in use" in err[0]
    assert cli.main(["rendezvous", "--port=70000"]) == 2
    assert "expected a TCP port in [1, 65535], got '70000'" in capsys.readouterr().err


def test_launcher_names_the_first_failure_and_its_cause(tmp_path, monkeypatch, capsys):
    """torchrun's own failure records (ProcessFailure reads the error file a worker wrote)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from raggedfsdp.cli.train import _child_failed
    from raggedfsdp.train.failures import report_failure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "metrics.jsonl").touch()  # the run has begun writing there: logs go there too
    try:
        raise RuntimeError("Connection reset by peer\nmore detail")
    except RuntimeError as err:
        assert report_failure(err, str(tmp_path)) == 1
    assert "more detail" in (tmp_path / "logs" / "rank_00000.log").read_text()  # the whole
    lost_peer = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(error_file))
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=str(tmp_path / "none"))
    capsys.readouterr()
    assert _child_failed(ChildFailedError("w", {0: lost_peer}), TrainConfig(), restarts=2) == 1
    line = capsys.readouterr().err.strip()
    assert line == (
        "raggedfsdp: error: training failed: worker rank 0 exited with status 1 after all "
        "restarts: rank 0: RuntimeError: Connection reset by peer"
    )
    # Within one second of torchrun's clock, the death by signal is the first failure.
    killed.timestamp = lost_peer.timestamp
    _child_failed(ChildFailedError("w", {0: lost_peer, 1: killed}), TrainConfig(), restarts=0)
    line = capsys.readouterr().err.strip()
    assert line == "raggedfsdp: error: training failed: worker rank 1 was killed by SIGKILL"
