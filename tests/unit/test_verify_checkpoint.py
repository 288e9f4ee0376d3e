"""Checkpoints verify themselves, on hand-made folders: ``COMPLETE.json`` records the size and
sha256 of every file, a damaged file is named, and the newest checkpoint that verifies is the one
chosen (and said so in one line). (What real launches do with damaged checkpoints:
tests/e2e/test_checkpoint_verify.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from raggedfsdp.train.run_dir import (
    COMPLETE,
    KEY_ENV,
    UNRECORDED_ENV,
    checkpoint_files,
    describe_fallback,
    resolve_checkpoint,
    sign_record,
    verified_checkpoint,
    verify_checkpoint,
)


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _hand_made(root: Path, step: int, **extra: Any) -> Path:
    path = root / "checkpoints" / f"step_{step:06d}"
    (path / "rng").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 96)  # 24,576 bytes
    (path / ".metadata").write_bytes(b"metadata")
    (path / "rng" / "rank_00000.pt").write_bytes(b"rng state")
    meta = {"step": step, "world_size": 1, "config": {}, "data": {"step": step}, **extra}
    if "files" not in meta:
        meta["files"] = checkpoint_files(path)
    (path / COMPLETE).write_text(json.dumps(meta))
    return path


def test_verify_checkpoint_on_a_hand_made_folder(tmp_path, monkeypatch):
    path = _hand_made(tmp_path, 30)
    records = json.loads((path / COMPLETE).read_text())["files"]
    assert sorted(records) == [".metadata", "__0_0.distcp", "rng/rank_00000.pt"]
    assert records["__0_0.distcp"]["bytes"] == 24_576
    assert len(records["__0_0.distcp"]["sha256"]) == 64
    assert verify_checkpoint(path) is None

    payload = path / "__0_0.distcp"
    original = payload.read_bytes()
    payload.write_bytes(original[:12_288])
    assert verify_checkpoint(path) == "__0_0.distcp: 12,288 bytes, expected 24,576"
    payload.write_bytes(original)
    _flip_byte(path / "rng" / "rank_00000.pt")
    reason = verify_checkpoint(path)
    assert reason is not None and reason.startswith("rng/rank_00000.pt: sha256 "), reason
    (path / "rng" / "rank_00000.pt").unlink()
    assert verify_checkpoint(path) == "rng/rank_00000.pt: missing"

    # Before format 2 COMPLETE.json recorded no files: nothing verifies such a checkpoint, so
    # it is refused, naming the override that accepts it unverified.
    old = _hand_made(tmp_path / "old", 10)
    meta = json.loads((old / COMPLETE).read_text())
    del meta["files"]
    (old / COMPLETE).write_text(json.dumps(meta))
    (old / "__0_0.distcp").write_bytes(b"anything")
    assert verify_checkpoint(old) == (
        f"{COMPLETE} records no files, so nothing verifies them; set {UNRECORDED_ENV}=1 to "
        f"accept it unverified"
    )
    monkeypatch.setenv(UNRECORDED_ENV, "1")
    assert verify_checkpoint(old) is None
    monkeypatch.delenv(UNRECORDED_ENV)

    assert verify_checkpoint(tmp_path / "nowhere") == f"it has no {COMPLETE}"
    (old / COMPLETE).write_text("{not json")
    assert verify_checkpoint(old).startswith(f"{COMPLETE} is corrupt")
    (old / COMPLETE).write_text(json.dumps({"step": 1, "config": {}}))
    assert verify_checkpoint(old) == f"{COMPLETE} lacks world_size, data"
    escape = _hand_made(tmp_path / "escape", 1, files={"../x": {"bytes": 1, "sha256": "0"}})
    assert "file name '../x'" in verify_checkpoint(escape)


def test_newest_verifying_checkpoint_is_chosen(tmp_path):
    good = _hand_made(tmp_path, 20)
    bad = _hand_made(tmp_path, 30)
    (bad / "__0_0.distcp").write_bytes(b"x" * 12_288)
    assert verified_checkpoint(tmp_path) == (
        good,
        [(bad, "__0_0.distcp: 12,288 bytes, expected 24,576")],
    )
    assert verified_checkpoint(tmp_path, fallback=False) == (None, [(bad, verify_checkpoint(bad))])
    chosen, skipped = verified_checkpoint(tmp_path)
    assert describe_fallback(tmp_path, skipped, chosen, "resuming from") == (
        "skipped checkpoints/step_000030 (__0_0.distcp: 12,288 bytes, expected 24,576); "
        "resuming from checkpoints/step_000020"
    )
    logged: list[str] = []
    assert resolve_checkpoint(tmp_path, log=logged.append) == good
    assert logged == [describe_fallback(tmp_path, skipped, chosen, "using")]
    with pytest.raises(ValueError, match=r"step_000030' does not verify \(__0_0\.distcp: 12,288"):
        resolve_checkpoint(bad)
    (good / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"no checkpoint of .* verifies: .*\.metadata: missing"):
        resolve_checkpoint(tmp_path)


def test_a_signed_record_refuses_a_folder_altered_without_the_secret(tmp_path, monkeypatch):
    """With a job secret, a checkpoint verifies only if its ``COMPLETE.json`` was signed by it:
    a file replaced and its checksum re-recorded (what anyone who can write the folder can do)
    no longer passes; nor does an unsigned record, nor one signed by another secret."""
    monkeypatch.setenv(KEY_ENV, "s3cret")
    path = _hand_made(tmp_path, 4)
    meta = json.loads((path / COMPLETE).read_text())
    (path / COMPLETE).write_text(json.dumps(sign_record(meta), indent=2))
    assert verify_checkpoint(path) is None
    assert len(json.loads((path / COMPLETE).read_text())["hmac_sha256"]) == 64

    (path / ".metadata").write_bytes(b"crafted")  # altered, its record rewritten to match
    altered = {**json.loads((path / COMPLETE).read_text()), "files": checkpoint_files(path)}
    (path / COMPLETE).write_text(json.dumps(altered))
    assert "its signature is not RAGGEDFSDP_CHECKPOINT_KEY's" in verify_checkpoint(path)
    del altered["hmac_sha256"]
    (path / COMPLETE).write_text(json.dumps(altered))
    assert "is not signed, and RAGGEDFSDP_CHECKPOINT_KEY is set" in verify_checkpoint(path)
    monkeypatch.setenv(KEY_ENV, "other")
    (path / COMPLETE).write_text(json.dumps(sign_record(altered)))
    monkeypatch.setenv(KEY_ENV, "s3cret")
    assert "its signature is not" in verify_checkpoint(path)
    # the negative control: without a secret, the checksums alone pass the altered folder
    monkeypatch.delenv(KEY_ENV)
    assert verify_checkpoint(path) is None
