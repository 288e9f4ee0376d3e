"""Membership changes with real torchrun agents on loopback: each "node" is a ``raggedfsdp train``
launcher with ``--nnodes``, a c10d rendezvous on 127.0.0.1 and one worker. A node is lost by
SIGKILL to its launcher alone (its worker must not outlive it); a replacement or a late joiner
is a new launcher with the lost node's command. Judged by the checkpoints and metrics the runs
leave: a replaced node's run ends bit for bit where the uninterrupted run ends; an elastic run
goes 2 -> 1 -> 2 ranks on two nodes and 3 -> 2 -> 3 on three, each time from the newest
checkpoint. The node lost is never the first one, which hosts the rendezvous (losing that one
ends the job), except behind a ``raggedfsdp rendezvous`` store, where any node may go. Every
launch runs under hard timeouts, and every process a test started is killed in its ``finally``.
Four scenarios (a replaced node; the first node lost, with and without the store; a worker
whose peers never come) run at once, in one module fixture: their waits (timeouts, a silent
node's 5 s, restarts) overlap.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from launches import (
    ENV,
    assert_same_tensors,
    cli_command,
    descendants,
    free_port,
    kill_tree,
    metrics,
    run_cli,
)
from raggedfsdp.train import health
from raggedfsdp.train.checkpoints import export_checkpoint
from raggedfsdp.train.run_dir import latest_checkpoint

# Rendezvous settings that keep the tests short: a lost node is declared dead after 5 s of
# silence (default 15 s; not fewer, as the suite's other worker loads the machine), and an
# elastic round waits 5 s for more nodes once one is there (default 30 s): long enough for the
# other nodes' launchers, imported ahead (NODE), to join, so the job starts at full size.
RDZV = "keep_alive_interval=1,keep_alive_max_attempt=5,last_call_timeout=5"
DEADLINE_S = 180  # for any one wait of a test (a loaded machine is slow to start workers)
LOSE_FIRST_STEPS = 60  # the steps of the runs that lose their first node
REPLACED_STEPS = 50  # the steps of the fixed-size job whose second node is replaced

# A node's launcher, started ahead of its time: it pays for its imports (seconds) at once, then
# waits for its gate file and, unless it hosts the rendezvous (port 0), for the rendezvous port
# before it runs ``raggedfsdp train`` as ``python -m raggedfsdp.cli`` does.
NODE = """
import os, socket, sys, time
import torch.distributed.run
from raggedfsdp import cli
import raggedfsdp.cli.train, raggedfsdp.train.launch
gate, port, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
while not os.path.exists(gate):
    time.sleep(0.02)
while port:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            break
    time.sleep(0.02)
sys.exit(cli.main(argv))
"""


def _args(corpus: Path, out: Path, *, steps: int, batch: int) -> list[str]:
    return [
        "--model=gpt-tiny",
        f"--steps={steps}",
        f"--batch-size={batch}",
        "--log-every=10",
        "--eval-every=0",
        "--eval-batches=1",
        "--checkpoint-every=10",
        "--warmup-steps=2",
        f"--data={corpus}",
        f"--out={out}",
    ]


@contextlib.contextmanager
def _cluster(
    tmp: Path, args: list[str], nodes: dict[str, int], *, store: bool = False
) -> Iterator[Callable[[str, int], subprocess.Popen]]:
    """``start(name, node_rank)`` starts node ``name`` of ``nodes`` (name -> node rank; its
    output in ``tmp/name.txt``), whose launcher began, to import, with the block; all of them are
    killed, with their workers, when the block ends. The first of ``nodes`` hosts the rendezvous
    (its store dies with it): the others wait for it to bind the port before they come, so the
    node the tests lose is never the host. With ``store``, a ``raggedfsdp rendezvous`` process
    hosts it instead (its output in ``tmp/store.log``)."""
    started: list[subprocess.Popen] = []
    port = free_port()
    common = [*args, f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}"]
    common.append(f"--rdzv-conf={RDZV}")
    ahead: dict[str, subprocess.Popen] = {}
    if store:
        with open(tmp / "store.log", "w") as log:
            started.append(
                subprocess.Popen(
                    cli_command("rendezvous", f"--port={port}"),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=ENV,
                    start_new_session=True,
                )
            )
        _wait_for("the rendezvous store", lambda: _listening(port))

    def start(name: str, node_rank: int) -> subprocess.Popen:
        assert nodes[name] == node_rank, (name, node_rank)
        (tmp / f"{name}.go").touch()
        return ahead[name]

    try:
        for i, (name, node_rank) in enumerate(nodes.items()):
            log = open(tmp / f"{name}.txt", "w")  # noqa: SIM115 - the child holds it
            wait_for_port = port if store or i > 0 else 0
            gate = str(tmp / f"{name}.go")
            launcher = [sys.executable, "-c", NODE, gate, str(wait_for_port), "train", *common]
            ahead[name] = subprocess.Popen(
                [*launcher, f"--node-rank={node_rank}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=ENV,
                start_new_session=True,
            )
            log.close()
            started.append(ahead[name])
        yield start
    except BaseException:
        # What each node and agent said, for the failure report (pytest shows stdout then).
        for log in sorted(tmp.glob("*.txt")) + sorted(tmp.glob("run/logs/agent_*.log")):
            print(f"==> {log}\n{log.read_text()[-3000:]}")
        raise
    finally:
        for node in started:
            kill_tree(node)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(what: str, condition: Callable[[], bool]) -> float:
    """Poll ``condition`` until it holds (the time then), failing after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic()


def _complete(out: Path, step: int) -> Callable[[], bool]:
    return lambda: (out / "checkpoints" / f"step_{step:06d}" / "COMPLETE.json").exists()


def _lose(node: subprocess.Popen) -> None:
    """SIGKILL a node's launcher alone, as the OOM killer or a lost host would; its worker must
    die with it (health.die_with_agent), or the job would go on without noticing."""
    workers = descendants(node.pid)
    assert workers, "the node has no worker"
    node.kill()
    node.wait(timeout=10)
    _wait_for("the lost node's workers to die", lambda: not any(_alive(p) for p in workers))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has died; its parent is gone


def _finish(tmp: Path, *nodes: tuple[str, subprocess.Popen]) -> dict[str, str]:
    """Wait for ``nodes`` to end; each one's output, after asserting it exited 0 and printed no
    traceback (workers' errors are one line; tracebacks go to OUT/logs)."""
    outputs = {}
    for name, node in nodes:
        node.wait(timeout=DEADLINE_S)
        outputs[name] = (tmp / f"{name}.txt").read_text()
        assert node.returncode == 0, f"{name}: exit {node.returncode}\n{outputs[name]}"
        assert "Traceback" not in outputs[name], outputs[name]
        # torchrun's own log lines ("W1202 12:00:00.000000 ...") stay off the terminal. (Not
        # torch's C++ warnings, "[W1202 ...] TCPStore.cpp": when the node hosting the
        # rendezvous store ends first, another agent's last store call may print one to its
        # stderr, which the workers share, so it cannot be moved to a file.)
        assert not re.search(r"^[IWE]\d{4} ", outputs[name], re.MULTILINE), outputs[name]
    return outputs


def _replace_a_node(tmp: Path, *, corpus: Path) -> tuple[Path, dict[str, str]]:
    """Two nodes of a fixed-size job, the second lost after the checkpoint of step 10 and
    replaced, into ``tmp/run``; the uninterrupted run beside them, into ``tmp/reference``:
    ``tmp`` and the nodes' outputs."""
    steps = REPLACED_STEPS
    reference = tmp / "reference"
    out = tmp / "run"
    args = [*_args(corpus, out, steps=steps, batch=4), "--nnodes=2", "--nproc=1"]
    # The uninterrupted run goes beside the cluster, whose waits leave the cores idle.
    uninterrupted = subprocess.Popen(
        cli_command("train", *_args(corpus, reference, steps=steps, batch=4), "--nproc=2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        with _cluster(tmp, [*args, "--max-restarts=2"], {"a": 0, "b": 1, "c": 1}) as start:
            a, b = start("a", 0), start("b", 1)
            _wait_for("the checkpoint of step 10", _complete(out, 10))
            _lose(b)
            lost = time.monotonic()
            c = start("c", 1)  # the replacement: node 1's command, on another machine
            outputs = _finish(tmp, ("a", a), ("c", c))
            print(f"replacement: {time.monotonic() - lost:.1f} s from the loss to the end")
        said = uninterrupted.communicate(timeout=DEADLINE_S)[0]
        assert uninterrupted.returncode == 0, f"exit {uninterrupted.returncode}\n{said}"
    finally:
        if uninterrupted.poll() is None:
            kill_tree(uninterrupted)
    return tmp, outputs


def test_replacement_node_joins_a_fixed_size_job(at_once):
    tmp_path, outputs = at_once["replacement"].result()
    reference, out = tmp_path / "reference", tmp_path / "run"
    # Rank 0 prints the resume. torchrun ranks the nodes by their agents' PIDs, so the
    # replacement is rank 0 when its PID is the smaller (after the PIDs wrap around).
    resumed = _resumed(tmp_path)
    assert len(resumed) == 1 and "saved on 2 rank(s), now 2)" in resumed.pop(), outputs
    records = metrics(out, "train")
    assert {r["world_size"] for r in records} == {2}
    assert records[-1]["step"] == REPLACED_STEPS
    # The one line of the survivor's worker that lost its peer; its traceback in OUT/logs.
    errors = [line for line in outputs["a"].splitlines() if line.startswith("raggedfsdp: error")]
    assert len(errors) == 1 and "(traceback in " in errors[0], outputs["a"]
    assert "Traceback" in Path(errors[0].split("(traceback in ")[1].rstrip(")")).read_text()
    final = {}
    for name, run in (("want", reference), ("got", out)):
        export_checkpoint(latest_checkpoint(run), tmp_path / f"{name}.pt")
        final[name] = torch.load(tmp_path / f"{name}.pt")
    assert_same_tensors(final["got"], final["want"])


def test_elastic_range_scales_down_and_back_up(tmp_path, corpus):
    steps = 300
    out = tmp_path / "run"
    args = [*_args(corpus, out, steps=steps, batch=16), "--nnodes=1:2", "--nproc=1"]
    with _cluster(tmp_path, [*args, "--max-restarts=3"], {"a": 0, "b": 1, "c": 1}) as start:
        a, b = start("a", 0), start("b", 1)
        _wait_for("the checkpoint of step 20", _complete(out, 20))
        _lose(b)
        lost = time.monotonic()
        _wait_for("the survivor to resume alone", lambda: _resumed_since(tmp_path, set(), 1))
        alone = time.monotonic()
        # a step trained alone first: a joiner arriving at once regroups before any (at load)
        _wait_for_step_at(out, world_size=1)
        c = start("c", 1)  # a late joiner
        # Rank 0 of the grown job, which prints the resume, may be either node (the one whose
        # agent has the smaller PID).
        _wait_for("the job to grow again", lambda: _resumed_since(tmp_path, set(), 2))
        print(
            f"elastic: {alone - lost:.1f} s to resume at 1 rank, "
            f"{time.monotonic() - alone:.1f} s from the joiner's start to 2 ranks"
        )
        outputs = _finish(tmp_path, ("a", a), ("c", c))
    records = metrics(out, "train")
    sizes = [r["world_size"] for r in records]
    phases = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert phases == [2, 1, 2], sizes
    # Each phase starts from the newest checkpoint of the one before (or, when the joiner
    # arrives, from the checkpoint the survivor saves as its agent stops it: no step lost).
    resumed = _resumed(tmp_path)
    assert len(resumed) == 2, outputs
    assert any("saved on 2 rank(s), now 1)" in line for line in resumed), resumed
    assert any("saved on 1 rank(s), now 2)" in line for line in resumed), resumed
    first_at_one = next(r["step"] for r in records if r["world_size"] == 1)
    grown = next(r["step"] for r in records if r["world_size"] == 2 and r["step"] > first_at_one)
    print(f"elastic: 1 rank from step {first_at_one}, 2 again from step {grown} of {steps}")
    assert first_at_one in (21, 30)  # log_every 10: the first step, or the first logged one
    assert records[-1]["step"] == steps and records[-1]["world_size"] == 2
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.fixture(scope="module")
def at_once(tmp_path_factory, corpus) -> dict[str, Future]:
    """The scenarios run at once, each in a folder of its own: by name, the future of what its
    test judges (an assertion inside a scenario is raised by its test's ``result()``)."""
    scenarios: dict[str, Callable[[Path], Any]] = {
        "replacement": functools.partial(_replace_a_node, corpus=corpus),
        "own-store": functools.partial(_lose_the_first_node, corpus=corpus, store=True),
        "node-hosts-store": functools.partial(_lose_the_first_node, corpus=corpus, store=False),
        "cannot-meet": functools.partial(_a_worker_that_cannot_meet_its_peers, corpus=corpus),
    }
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {
            name: pool.submit(scenario, tmp_path_factory.mktemp(name))
            for name, scenario in scenarios.items()
        }
    return futures  # all done: the pool waits for them as it closes


def _lose_the_first_node(tmp: Path, *, corpus: Path, store: bool) -> dict[str, Any]:
    """Two nodes, the first lost after the checkpoint of step 20: without ``store``, the
    survivor's exit status and output lines; with it, its output, the resumes and the train
    records."""
    out = tmp / "run"
    args = [*_args(corpus, out, steps=LOSE_FIRST_STEPS, batch=8), "--nnodes=1:2", "--nproc=1"]
    with _cluster(tmp, [*args, "--max-restarts=2"], {"a": 0, "b": 1}, store=store) as start:
        a, b = start("a", 0), start("b", 1)
        _wait_for("the checkpoint of step 20", _complete(out, 20))
        _lose(a)
        if not store:
            b.wait(timeout=DEADLINE_S)
            return {"status": b.returncode, "lines": (tmp / "b.txt").read_text().splitlines()}
        outputs = _finish(tmp, ("b", b))
    return {"outputs": outputs, "resumed": _resumed(tmp), "records": metrics(out, "train")}


@pytest.mark.parametrize("store", [True, False], ids=["own-store", "node-hosts-store"])
def test_losing_the_first_node_behind_a_rendezvous_store(at_once, store):
    """With ``raggedfsdp rendezvous`` hosting the store, losing the first node (the one that
    would host it) leaves the other training alone to the end. Without it (the negative
    control) the rendezvous goes with that node and the survivor ends in one line."""
    got = at_once["own-store" if store else "node-hosts-store"].result()
    if not store:
        lines = got["lines"]
        assert got["status"] == 1, lines
        assert lines[-1].startswith("raggedfsdp: error: the nodes did not meet at"), lines
        return
    assert "now 1)" in "".join(got["resumed"]), got["outputs"]
    sizes = [r["world_size"] for r in got["records"]]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [2, 1], sizes
    assert got["records"][-1]["step"] == LOSE_FIRST_STEPS


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_three_nodes_lose_one_and_take_a_late_joiner(tmp_path, corpus):
    """Three nodes in an elastic range of 2 to 3: one node is lost, the two survivors go on at
    2 ranks from the newest checkpoint, and a late joiner brings the job back to 3."""
    steps = 300
    out = tmp_path / "run"
    args = [*_args(corpus, out, steps=steps, batch=12), "--nnodes=2:3", "--nproc=1"]
    nodes = {"a": 0, "b": 1, "c": 2, "d": 2}
    with _cluster(tmp_path, [*args, "--max-restarts=4"], nodes) as start:
        a, b, c = start("a", 0), start("b", 1), start("c", 2)
        # The job may start at 2 and grow when the third launcher is late: wait for 3 ranks,
        # then for a checkpoint those 3 ranks saved.
        at_three = _wait_for_step_at(out, world_size=3)
        _wait_for("a checkpoint saved by 3 ranks", _complete(out, (at_three // 10 + 1) * 10))
        before = _resumed(tmp_path)
        _lose(c)
        lost = time.monotonic()
        _wait_for("the survivors to resume at 2", lambda: _resumed_since(tmp_path, before, 2))
        survived = time.monotonic()
        # a step trained at 2 first: a joiner arriving at once regroups before any (at load)
        _wait_for_step_at(out, world_size=2, after=at_three)
        d = start("d", 2)  # a late joiner
        _wait_for("the job to grow again", lambda: _resumed_since(tmp_path, before, 3))
        print(
            f"three nodes: {survived - lost:.1f} s to resume at 2 ranks, "
            f"{time.monotonic() - survived:.1f} s from the joiner's start to 3 ranks"
        )
        _finish(tmp_path, ("a", a), ("b", b), ("d", d))
    sizes = [r["world_size"] for r in metrics(out, "train")]
    phases = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert phases[-3:] == [3, 2, 3], sizes
    after = _resumed(tmp_path) - before
    assert len(after) == 2, after  # one resume at 2 ranks, one at 3 (printed by rank 0)
    assert any("saved on 3 rank(s), now 2)" in line for line in after), after
    assert any("saved on 2 rank(s), now 3)" in line for line in after), after
    records = metrics(out, "train")
    assert records[-1]["step"] == steps and records[-1]["world_size"] == 3
    assert records[-1]["loss"] < records[0]["loss"]


def _resumed(tmp: Path) -> set[str]:
    """The resumes the nodes have printed so far (rank 0 prints each; it may be any node)."""
    lines = (line for log in tmp.glob("*.txt") for line in _text(log).splitlines())
    return {line for line in lines if line.startswith("resumed from")}


def _resumed_since(tmp: Path, before: set[str], world_size: int) -> bool:
    """Whether the job has resumed at ``world_size`` ranks since the resumes in ``before``."""
    return any(f"now {world_size})" in line for line in _resumed(tmp) - before)


def _wait_for_step_at(out: Path, *, world_size: int, after: int = -1) -> int:
    """The first logged step after ``after`` that ``world_size`` ranks trained (waiting for
    one)."""

    def steps() -> list[int]:
        if not (out / "metrics.jsonl").exists():
            return []
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.endswith("}")]
        trained = (r for r in records if r["kind"] == "train")
        return [r["step"] for r in trained if r["world_size"] == world_size and r["step"] > after]

    _wait_for(f"a step at {world_size} ranks", lambda: bool(steps()))
    return steps()[0]


def test_a_node_alone_ends_in_one_line_within_the_startup_timeout(tmp_path, corpus):
    # Not among the scenarios run at once: its bound is on its own wall time.
    out = tmp_path / "run"
    args = [*_args(corpus, out, steps=4, batch=4), "--nnodes=2", "--nproc=1"]
    started = time.monotonic()
    proc = run_cli(
        "train", *args, f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=alone",
        "--startup-timeout-s=2",
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and time.monotonic() - started < 30
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raggedfsdp: error: the nodes did not meet")
    assert "RendezvousTimeoutError" in lines[0], proc.stderr
    assert not out.exists()  # a refused start leaves nothing


def _a_worker_that_cannot_meet_its_peers(tmp: Path, *, corpus: Path) -> subprocess.CompletedProcess:
    """A worker of rank 1 whose rank 0 never comes, started without a launcher."""
    env = {
        **ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),  # nobody there: rank 0 never comes
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
    }
    command = [sys.executable, "-m", "raggedfsdp.train", "--model=gpt-tiny", f"--data={corpus}"]
    command += [f"--out={tmp / 'run'}", "--startup-timeout-s=2"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_a_worker_that_cannot_meet_its_peers_ends_in_one_line(at_once):
    proc = at_once["cannot-meet"].result()
    assert proc.returncode == health.WATCHDOG_EXIT_CODE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "rank 1: start-up (meeting the other ranks of 2) has run for" in lines[0]
    assert "--startup-timeout-s=2" in lines[0]
