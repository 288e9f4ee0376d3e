"""The trust boundary (SECURITY.md): what a run folder and the rendezvous network can do to a
job. Each case plants a payload that would only write a marker file (crafted ``.metadata`` and
RNG files, a pickle under the job's key in the store) or a link among the outputs, and asserts
the marker never appears, nothing is written through the link, and the command says one line
naming the thing at fault. Negative controls: genuine checkpoints (raggedfsdp's, torch's DCP,
FSDP2's) still load; a signed one exports; the store without ``--host`` takes every address.
(Model configs: tests/unit/test_train_hf_build_and_errors.py; data: tests/unit/test_data.py;
signing hand-made records: tests/unit/test_verify_checkpoint.py.)

The launches are real ``raggedfsdp train`` runs (2 CPU workers) of gpt-tiny: one of 2 steps
that saves a checkpoint, whose listening sockets are sampled while it runs and whose copies the
cases alter, then resume side by side; one made with ``--user-only`` under a job secret, checked
both ways.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from launches import (
    ENV,
    cli_command,
    descendants,
    free_port,
    kill_tree,
    ok,
    run_cli,
    run_side_by_side,
)
from raggedfsdp.train.checkpoints import load_full
from raggedfsdp.train.run_dir import COMPLETE, KEY_ENV, checkpoint_files, verify_checkpoint

COMMON = [
    "--model=gpt-tiny",
    "--batch-size=4",
    "--warmup-steps=1",
    "--log-every=1",
    "--eval-every=0",
    "--eval-batches=1",
    "--checkpoint-every=2",
]
STEP2 = "checkpoints/step_000002"
_run = functools.partial(run_cli, timeout=120)


class _Payload:
    """Unpickled, it runs ``touch MARKER``: what a crafted checkpoint file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _reseal(checkpoint: Path) -> None:
    """Record the checkpoint's files as they are now in its ``COMPLETE.json``: what anyone who
    can write the folder can do, so the checksums alone prove nothing about who wrote it."""
    record = json.loads((checkpoint / COMPLETE).read_text())
    record["files"] = checkpoint_files(checkpoint)
    (checkpoint / COMPLETE).write_text(json.dumps(record))
    assert verify_checkpoint(checkpoint) is None


def _refused(proc, *fragments: str) -> str:
    """The one error line of a command refused before anything ran; it names ``fragments``."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("raggedfsdp: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, corpus) -> tuple[Path, set[tuple[str, int]]]:
    """A run folder of 2 steps (2 workers) with its checkpoint of step 2, and every address its
    processes listened on while it ran."""
    out = tmp_path_factory.mktemp("source") / "run"
    train = [*COMMON, "--steps=2", "--nproc=2", f"--data={corpus}", f"--out={out}"]
    return out, _listeners_of_a_run(cli_command("train", *train), out)


@pytest.fixture(scope="module")
def source(sampled) -> Path:
    return sampled[0]


@pytest.fixture(scope="module")
def signed(tmp_path_factory, corpus) -> Path:
    """A run folder of 2 steps made with ``--user-only`` under a job secret
    (RAGGEDFSDP_CHECKPOINT_KEY): its checkpoints signed, its files this user's alone."""
    out = tmp_path_factory.mktemp("signed") / "run"
    args = [*COMMON, "--steps=2", f"--data={corpus}", f"--out={out}", "--user-only"]
    ok(_run("train", *args, env={**ENV, KEY_ENV: "job-secret"}))
    return out


CRAFTED = (".metadata", "rng/rank_00000.pt")
LINKED = ("metrics.jsonl", "config.json", f"{STEP2[:-1]}4.tmp")


def _plant_payload(run: Path, where: Path, file: str) -> None:
    """``file`` of the step-2 checkpoint becomes a pickle that writes ``where/MARKER``, its
    checksum re-recorded."""
    marker = where / "MARKER"
    ckpt = run / STEP2
    if file == ".metadata":
        (ckpt / file).write_bytes(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"torch": _Payload(marker)}, ckpt / file)
    _reseal(ckpt)


def _plant_link(run: Path, where: Path, name: str) -> None:
    """``name`` among the run's outputs becomes a link to ``where/victim`` (a file of the
    victim's, or for a checkpoint's temporary folder, a folder)."""
    victim = where / "victim"
    victim.mkdir() if name.endswith(".tmp") else victim.write_text("precious\n")
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(victim)


@pytest.fixture(scope="module")
def resumes(source, tmp_path_factory, corpus) -> dict[tuple[str, str], tuple[Path, Any]]:
    """Copies of the source run, each altered by one case (``(kind, file)``), and one untouched
    (``("genuine", "")``), resumed side by side (a refused command spends its time starting an
    interpreter, and these starts overlap), with the crafted ``.metadata`` copy exported
    (``("export", ".metadata")``): by case, the folder holding the copy (``run``) and what the
    case planted, and the command's result."""
    plants = {("crafted", file): _plant_payload for file in CRAFTED}
    plants |= {("link", name): _plant_link for name in LINKED}
    folders, commands = {}, {}
    for (kind, name), plant in [*plants.items(), (("genuine", ""), None)]:
        where = folders[kind, name] = tmp_path_factory.mktemp(kind)
        shutil.copytree(source, where / "run")
        if plant is not None:
            plant(where / "run", where, name)
        train = [*COMMON, "--steps=4", f"--data={corpus}", f"--out={where / 'run'}", "--resume"]
        commands[kind, name] = cli_command("train", *train)
    where = folders["export", ".metadata"] = folders["crafted", ".metadata"]
    commands["export", ".metadata"] = cli_command(
        "export", f"--checkpoint={where / 'run'}", f"--out={where / 'model.pt'}"
    )
    done = run_side_by_side(*commands.values(), timeout=300)
    return {case: (folders[case], proc) for case, proc in zip(commands, done, strict=True)}


@pytest.mark.parametrize("file", CRAFTED)
def test_a_crafted_checkpoint_file_runs_nothing(resumes, source, file):
    where, resume = resumes["crafted", file]
    run, marker = where / "run", where / "MARKER"
    ckpt = run / STEP2
    line = _refused(resume, f"{ckpt / file}'", "posix.system")
    trained = (source / "metrics.jsonl").read_bytes()
    assert (run / "metrics.jsonl").read_bytes() == trained  # refused before any worker
    if file == ".metadata":  # export reads only the model: DCP's metadata and files
        _, export = resumes["export", file]
        _refused(export, f"{ckpt / file}'", "posix.system")
        assert not (where / "model.pt").exists()
    assert not marker.exists(), line
    # the negative control: the same payload through plain pickle does write the marker
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


def test_genuine_checkpoints_of_torch_dcp_load(tmp_path):
    """A checkpoint written by torch's own ``dcp.save`` (no raggedfsdp) loads through the
    allow-list reader, every dtype and a non-tensor entry alike."""
    state = {
        "model.w": torch.randn(3, 5),
        "model.h": torch.randn(4).to(torch.bfloat16),
        "model.i": torch.arange(6),
        "model.step": 7,
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    loaded = load_full(tmp_path, "model.")
    assert loaded.keys() == {"w", "h", "i"}
    for key in loaded:
        assert torch.equal(loaded[key], state[f"model.{key}"])


def _fsdp2_save(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    dcp.save(state, checkpoint_id=path)
    return {key: value.full_tensor() for key, value in model.state_dict().items()}


def test_genuine_checkpoints_of_fsdp2_load(tmp_path):
    """A checkpoint of FSDP2's sharded DTensors on 2 ranks loads whole through the reader."""
    from raggedfsdp.spawn import run_on_ranks

    full, _ = run_on_ranks(_fsdp2_save, 2, str(tmp_path), timeout=120)
    loaded = load_full(tmp_path, "model.")
    assert loaded.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(loaded[key], value), key


def test_genuine_raggedfsdp_checkpoint_resumes(resumes):
    """The negative control of the crafted files: the same folder, untouched, resumes (DCP's
    metadata, the files and the RNG states all read through the checks above)."""
    where, proc = resumes["genuine", ""]
    ok(proc)
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout
    assert verify_checkpoint(where / "run/checkpoints/step_000004") is None


@pytest.mark.parametrize("name", LINKED)
def test_outputs_are_never_written_through_a_planted_link(resumes, name):
    """A link planted among a run's outputs (pointing at a file of the victim's) refuses the
    resume in one line naming it; the file it points at is untouched."""
    where, proc = resumes["link", name]
    run, victim = where / "run", where / "victim"
    _refused(proc, f"{run / name}'", "symbolic link")
    if name.endswith(".tmp"):
        assert not any(victim.iterdir())
    else:
        assert victim.read_text() == "precious\n"


def test_early_tracebacks_go_to_a_private_new_folder(tmp_path, monkeypatch, capsys):
    """Before the run folder holds outputs, a worker's traceback goes to a folder tempfile
    makes (mode 0700, a name nobody could plant), never to ``TMP/raggedfsdp-PID``, where a
    link may wait."""
    import tempfile

    from raggedfsdp.train.failures import report_failure

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"raggedfsdp-{os.getpid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted.symlink_to(elsewhere)
    try:
        raise RuntimeError("boom")
    except RuntimeError as err:
        assert report_failure(err, None) == 1
    line = capsys.readouterr().err
    log = Path(line.split("(traceback in ")[1].split(")")[0])
    assert "boom" in log.read_text()
    assert log.parent.parent == tmp_path and log.parent != planted
    assert log.parent.stat().st_mode & 0o777 == 0o700
    assert not any(elsewhere.iterdir())


def _connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


@pytest.mark.parametrize("host", ["127.0.0.1", None])
def test_the_rendezvous_store_listens_where_it_is_told(host):
    """``raggedfsdp rendezvous --host 127.0.0.1`` takes no connection at 127.0.0.2 (another
    loopback address of this machine); without ``--host``, the negative control, it does."""
    port = free_port()
    args = [f"--port={port}"] + ([f"--host={host}"] if host else [])
    proc = subprocess.Popen(
        cli_command("rendezvous", *args), stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        said = proc.stdout.readline()
        assert "rendezvous store listening" in said, said
        assert ("no authentication" in said) == (host is None), said
        assert _connects("127.0.0.1", port)
        assert _connects("127.0.0.2", port) == (host is None)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_crafted_rendezvous_state_runs_nothing(tmp_path, corpus):
    """A process that reaches the store writes a pickle under a job's key (base64, as torch's
    c10d backend stores its state): the launcher refuses it in one line and runs nothing. The
    valid states of a real rendezvous: the multi-node tests (test_elastic, test_train)."""
    from torch.distributed import TCPStore

    marker = tmp_path / "MARKER"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    payload = base64.b64encode(pickle.dumps(_Payload(marker)))
    store.set("torch.rendezvous.victim", payload)
    out = tmp_path / "run"
    proc = _run(
        "train", *COMMON, "--steps=2", f"--data={corpus}", f"--out={out}", "--nnodes=2",
        "--nproc=1", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=victim",
        "--startup-timeout-s=10",
    )  # fmt: skip
    assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "RendezvousStateError" in lines[0], proc.stderr
    assert "'torch.rendezvous.victim'" in lines[0] and "posix.system" in lines[0], lines[0]
    assert not marker.exists()


def test_a_launcher_hosts_the_store_of_an_ip_endpoint_there_alone():
    """The store a launcher hosts for ``--rdzv-endpoint 127.0.0.1:PORT`` (through the backend
    raggedfsdp's launchers name to torchrun) takes no connection at 127.0.0.2."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    from raggedfsdp.train.rendezvous import BACKEND, register_backend

    register_backend()
    port = free_port()
    params = RendezvousParameters(BACKEND, f"127.0.0.1:{port}", "job", 1, 1)
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        assert _connects("127.0.0.1", port) and not _connects("127.0.0.2", port)
    finally:
        handler.shutdown()


def _listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this machine: ``inode -> (address, port)``."""
    found = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            packed = bytes.fromhex(address)
            # /proc writes each 32-bit word of the address in host (little-endian) order.
            words = [packed[i : i + 4][::-1] for i in range(0, len(packed), 4)]
            family = socket.AF_INET if width == 8 else socket.AF_INET6
            found[int(fields[9])] = (socket.inet_ntop(family, b"".join(words)), int(port, 16))
    return found


def _listeners_of(pids: list[int]) -> set[tuple[str, int]]:
    """The ``(address, port)`` each of ``pids`` listens on now."""
    listening, out = _listening(), set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}").glob("fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:[") : -1])
                if inode in listening:
                    out.add(listening[inode])
    return out


def _listeners_of_a_run(command: list[str], out: Path) -> set[tuple[str, int]]:
    """Every address the processes of ``command`` (a one-node job of two workers) listened on
    while it ran, sampled until it ended."""
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=ENV)
    seen: set[tuple[str, int]] = set()
    try:
        while proc.poll() is None:
            seen |= _listeners_of([proc.pid, *descendants(proc.pid)])
            # The sockets sampled live from a store's or a group's start to the job's end
            # (seconds): a short pause leaves the cores to the job (a sample takes ~10 ms).
            time.sleep(0.02)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, log.read_text()
    return seen


def test_a_one_node_job_listens_on_loopback_alone(sampled, tmp_path, corpus):
    """Every store of a one-node ``raggedfsdp train`` (the rendezvous store, the workers' store)
    and the workers' Gloo listen on 127.0.0.1 alone (the source run, 2 workers). Negative
    control: the same workers under torchrun's own ``--standalone`` listen on every address."""
    _, ours = sampled
    assert len(ours) >= 3, ours  # the workers' store and each worker's Gloo, at least
    assert {address for address, _ in ours} == {"127.0.0.1"}, ours
    worker = [*COMMON, "--steps=2", f"--data={corpus}", f"--out={tmp_path / 'torch'}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    theirs = _listeners_of_a_run([*torchrun, "-m", "raggedfsdp.train", *worker], tmp_path / "torch")
    assert {address for address, _ in theirs} & {"0.0.0.0", "::"}, theirs


def test_a_job_secret_refuses_a_folder_altered_without_it(signed, tmp_path, corpus):
    """With RAGGEDFSDP_CHECKPOINT_KEY the run signs its checkpoints: the crafted ``.metadata``
    with its checksum re-recorded (which passes the checksums alone, above) is refused at
    resume, in one line; the untouched checkpoint exports under the same secret."""
    env = {**ENV, KEY_ENV: "job-secret"}
    out = tmp_path / "run"
    shutil.copytree(signed, out)
    ok(_run("export", f"--checkpoint={out}", f"--out={tmp_path / 'model.pt'}", env=env))
    marker = tmp_path / "MARKER"
    (out / STEP2 / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _reseal(out / STEP2)
    args = ["train", *COMMON, "--steps=4", f"--data={corpus}", f"--out={out}", "--resume"]
    line = _refused(_run(*args, env=env), "cannot resume", "its signature is not")
    assert KEY_ENV in line and not marker.exists()


def test_user_only_runs_write_nothing_others_may_read(signed, source):
    """``--user-only``: every file and folder of the run (checkpoints, metrics, logs, the
    lock) is this user's alone; without it (the control, the source run) modes follow the
    umask, as SECURITY.md says."""
    written = [signed, *signed.rglob("*")]
    assert len(written) > 10
    assert [p for p in written if p.stat().st_mode & 0o077] == []
    umask = os.umask(0)
    os.umask(umask)
    assert (source / "metrics.jsonl").stat().st_mode & 0o777 == 0o666 & ~umask


def test_help_says_the_store_has_no_authentication(capsys):
    from raggedfsdp import cli

    assert cli.main(["rendezvous", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "The store has no authentication" in text and "private network" in text
    assert "--host ADDR" in text
