"""The run's output folder (``--out``): what a run writes there, and which checkpoints are intact.

What a run writes, which checkpoints are complete and verify (their files' sizes and sha256 in
``COMPLETE.json``, signed with a job secret when one is given), and whether a new run may use the
folder. :func:`verified_checkpoint` is the newest checkpoint that verifies, and which newer ones did
not and why: what ``--resume`` and ``raggedfsdp export`` of a run folder use. The design: [Note:
checkpoints verify themselves] at :func:`checkpoint_files`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "CHECKPOINTS",
    "CHECKSUM",
    "COMPLETE",
    "COMPLETE_KEYS",
    "JOB_ENV",
    "KEY_ENV",
    "LOCK",
    "OUTPUTS",
    "UNRECORDED_ENV",
    "check_no_links",
    "check_out_dir",
    "checkpoint_files",
    "checkpoint_path",
    "current_job",
    "describe_fallback",
    "free_space",
    "has_outputs",
    "latest_checkpoint",
    "prepare_out_dir",
    "remove_entry",
    "remove_partial",
    "resolve_checkpoint",
    "resume_checkpoint",
    "sign_record",
    "verified_checkpoint",
    "verify_checkpoint",
]

#: Folder of the checkpoints inside ``--out``.
CHECKPOINTS = "checkpoints"
#: The marker (and metadata) that makes a checkpoint folder complete.
COMPLETE = "COMPLETE.json"
#: What every ``COMPLETE.json`` holds (the records of its files only since format version 2).
COMPLETE_KEYS = ("step", "world_size", "config", "data")
#: The checksum ``COMPLETE.json`` records for each file (module Note).
CHECKSUM = "sha256"
#: Everything a training run writes into ``--out``; ``--overwrite`` deletes only these.
OUTPUTS = (
    CHECKPOINTS,
    "metrics.jsonl",
    "report.png",
    "config.json",
    "tensorboard",
    "logs",
    ".faults",
)

#: The run-folder lock (:mod:`.run_lock`): no output of a run, never deleted by ``--overwrite``.
LOCK = ".lock"
#: The environment variable in which the launcher names the job to its workers
#: (:func:`current_job`).
JOB_ENV = "RAGGEDFSDP_JOB"

#: The environment variable holding the job's secret that signs every ``COMPLETE.json`` it
#: writes and that a checkpoint it reads must be signed with (module Note).
KEY_ENV = "RAGGEDFSDP_CHECKPOINT_KEY"
#: The environment variable that, set to ``1``, accepts a checkpoint whose ``COMPLETE.json``
#: records no files (module Note).
UNRECORDED_ENV = "RAGGEDFSDP_ACCEPT_UNRECORDED"
#: The key of the signature in ``COMPLETE.json``.
_SIGNATURE = "hmac_sha256"

_STEP_DIR = re.compile(r"^step_(\d+)$")


def current_job() -> str:
    """The job this process works for, as its checkpoints record it: what ``raggedfsdp train``'s
    launcher names (:data:`JOB_ENV`: the same on every node and through every restart), else
    torchrun's run id, else this process."""
    return (
        os.environ.get(JOB_ENV)
        or os.environ.get("TORCHELASTIC_RUN_ID")
        or f"{socket.gethostname()}:{os.getpid()}"
    )


def has_outputs(out: str | Path) -> bool:
    """Whether ``out`` is a folder holding anything but the lock: a run has begun writing there
    (before, a file there would make a corrected command's folder "not empty")."""
    out = Path(out)
    return out.is_dir() and any(entry.name != LOCK for entry in out.iterdir())


def checkpoint_path(out: str | Path, step: int) -> Path:
    """``OUT/checkpoints/step_000123`` (six digits, more when needed)."""
    return Path(out) / CHECKPOINTS / f"step_{step:06d}"


def _step_folders(out: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` folder under ``OUT/checkpoints`` with its step, complete or not
    (``.tmp`` folders aside), by step."""
    root = out / CHECKPOINTS
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in _step_folders(out) if (path / COMPLETE).is_file()]


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete checkpoint under ``OUT/checkpoints`` (``.tmp`` folders ignored), by
    its ``COMPLETE.json`` alone: cheap, nothing read; :func:`verified_checkpoint` also checks its
    files."""
    found = _complete_checkpoints(Path(out))
    return found[-1][1] if found else None


def remove_partial(out: str | Path) -> list[Path]:
    """Delete the ``.tmp`` folders of saves that never completed; returns them. Call on one rank
    while no save is in flight (at start-up)."""
    root = Path(out) / CHECKPOINTS
    removed = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    for path in removed:
        remove_entry(path)
    return removed


def remove_entry(path: Path) -> None:
    """Delete ``path`` (a file, a folder and what it holds, or a symbolic link) without ever
    following a link: what a run deletes in its folder is the folder's own."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def check_no_links(out: str | Path) -> None:
    """``ValueError`` naming the first symbolic link among the outputs of the run folder
    ``out`` (:data:`OUTPUTS` and all they hold): a run resumed there would write through it,
    wherever it points (SECURITY.md). ``out`` itself may be a link: the user chose it."""
    out = Path(out)
    for name in OUTPUTS:
        top = out / name
        tree = os.walk(top) if top.is_dir() and not top.is_symlink() else ()
        for entry in (top, *(Path(d) / n for d, dirs, files in tree for n in dirs + files)):
            if entry.is_symlink():
                raise ValueError(
                    f"out: {str(entry)!r} is a symbolic link (to {os.readlink(entry)!r}); a run "
                    f"writes its outputs only into its own folder: remove the link to resume"
                )


# ---------------------------------------------------------------------------------------------
# Verification (module Note).

_CHUNK = 1 << 20
_HASH_THREADS = 8


def _checksum(file: Path) -> str:
    digest = hashlib.new(CHECKSUM)
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _checksums(files: Sequence[Path]) -> list[str]:
    """The checksums of ``files``, in order; several files are hashed at once (the GIL is
    released while hashing, and a shared file system serves parallel reads faster)."""
    if len(files) <= 1:
        return [_checksum(f) for f in files]
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(files))) as pool:
        return list(pool.map(_checksum, files))


# [Note: checkpoints verify themselves] ``COMPLETE.json`` records every other file of its checkpoint
# (DCP's ``.distcp`` files and ``.metadata``, the ``rng/rank_*.pt`` files): its size in bytes and
# its sha256 (:func:`checkpoint_files`). :func:`verify_checkpoint` checks them, sizes first (cheap:
# a torn copy or a truncated file shows there), then the checksums (a flipped bit of a file of the
# right size). Measured on a 50 MB file (a shared 2-core machine, so a range): sha256 39-77 ms, i.e.
# 0.65-1.3 GB/s on one core; zlib's crc32 29-47 ms; reading it from the page cache 17-39 ms. A
# faster checksum would gain too little to give up one that ``sha256sum`` checks by hand. Files are
# hashed in up to 8 threads (hashlib releases the GIL): for many ranks' files on a network file
# system; on 2 busy cores it gained nothing. The checksums prove integrity, not authenticity:
# whoever can write the folder can rewrite ``COMPLETE.json`` too. With a job secret in
# :data:`KEY_ENV`, rank 0 signs the record (an HMAC-SHA256 of all of it but the signature, in
# canonical JSON: :func:`sign_record`), and verification refuses a record without a signature that
# this secret makes (compared in constant time): a folder altered by someone without the secret no
# longer verifies. A record without ``files`` (format version 1, or stripped) verifies nothing, so
# it is refused unless :data:`UNRECORDED_ENV` is ``1``.
def checkpoint_files(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hex}}`` for every file of the checkpoint folder
    ``path`` but its ``COMPLETE.json``; names are POSIX paths relative to ``path``
    (``__0_0.distcp``, ``.metadata``, ``rng/rank_00000.pt``)."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p != root / COMPLETE)
    sizes = [f.stat().st_size for f in files]
    return {
        f.relative_to(root).as_posix(): {"bytes": size, CHECKSUM: digest}
        for f, size, digest in zip(files, sizes, _checksums(files), strict=True)
    }


def _file_records(records: Any) -> dict[str, tuple[int, str]] | str:
    """The ``files`` of a ``COMPLETE.json`` as ``{name: (bytes, checksum)}``, or why not."""
    if not isinstance(records, dict):
        return f"{COMPLETE} is corrupt (its files are not a mapping)"
    out: dict[str, tuple[int, str]] = {}
    for name, record in records.items():
        parts = PurePosixPath(name).parts
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
            return f"{COMPLETE} is corrupt (file name {name!r})"
        size = record.get("bytes") if isinstance(record, dict) else None
        digest = record.get(CHECKSUM) if isinstance(record, dict) else None
        if not isinstance(size, int) or not isinstance(digest, str):
            return f"{COMPLETE} is corrupt (the record of {name} has no bytes and {CHECKSUM})"
        out[name] = (size, digest)
    return out


def _signature(record: dict[str, Any], key: str) -> str:
    signed = {name: value for name, value in record.items() if name != _SIGNATURE}
    # As the file will read back (tuples as lists, keys as strings), then canonical.
    text = json.dumps(json.loads(json.dumps(signed)), sort_keys=True, separators=(",", ":"))
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def sign_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (a ``COMPLETE.json``) with its signature by the secret in :data:`KEY_ENV`;
    as it is when none is set."""
    key = os.environ.get(KEY_ENV)
    return {**record, _SIGNATURE: _signature(record, key)} if key else record


def _check_signature(meta: dict[str, Any]) -> str | None:
    """Why ``meta`` is not signed by the secret in :data:`KEY_ENV`; None when it is, or when no
    secret is set (nothing to check it with)."""
    key = os.environ.get(KEY_ENV)
    if not key:
        return None
    given = meta.get(_SIGNATURE)
    if not isinstance(given, str):
        return f"{COMPLETE} is not signed, and {KEY_ENV} is set: refused"
    if not hmac.compare_digest(given, _signature(meta, key)):
        return (
            f"{COMPLETE}: its signature is not {KEY_ENV}'s (altered, or written by another "
            f"job's secret): refused"
        )
    return None


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint folder ``path`` is intact, else why not, in a few words that
    name the file (``__0_0.distcp: 12,288 bytes, expected 24,576``).

    Checks that ``COMPLETE.json`` is readable, has its keys and, with a secret in
    :data:`KEY_ENV`, is signed by it; then that every file it records exists with the recorded
    size, then the recorded checksums. A record without files (format version 1) is refused,
    unless :data:`UNRECORDED_ENV` is ``1``. Files not recorded are ignored. Reads the whole
    checkpoint (module Note: ~650 MB/s per core)."""
    root = Path(path)
    try:
        meta = json.loads((root / COMPLETE).read_text())
    except FileNotFoundError:
        return f"it has no {COMPLETE}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{COMPLETE} is corrupt ({err})"
    if not isinstance(meta, dict):
        return f"{COMPLETE} is corrupt (not a JSON object)"
    missing = [key for key in COMPLETE_KEYS if key not in meta]
    if missing:
        return f"{COMPLETE} lacks {', '.join(missing)}"
    named = _STEP_DIR.match(root.name)
    if named and meta["step"] != int(named.group(1)):
        return f"{COMPLETE} records step {meta['step']}, not {int(named.group(1))}"
    unsigned = _check_signature(meta)
    if unsigned is not None:
        return unsigned
    if "files" not in meta:  # written before the files were recorded, or stripped
        if os.environ.get(UNRECORDED_ENV) == "1":
            return None
        return (
            f"{COMPLETE} records no files, so nothing verifies them; set {UNRECORDED_ENV}=1 "
            f"to accept it unverified"
        )
    records = _file_records(meta["files"])
    if isinstance(records, str):
        return records
    for name, (size, _) in records.items():
        try:
            actual = (root / name).stat().st_size
        except FileNotFoundError:
            return f"{name}: missing"
        except OSError as err:
            return f"{name}: {err.strerror or err}"
        if actual != size:
            return f"{name}: {actual:,} bytes, expected {size:,}"
    try:
        digests = _checksums([root / name for name in records])
    except OSError as err:
        name = _relative(Path(err.filename), root) if err.filename else "a file"
        return f"{name}: unreadable ({err.strerror or err})"
    for (name, (_, expected)), digest in zip(records.items(), digests, strict=True):
        if digest != expected:
            return (
                f"{name}: {CHECKSUM} {digest[:12]}..., expected {expected[:12]}... (same size, "
                f"other content)"
            )
    return None


def verified_checkpoint(
    out: str | Path, *, fallback: bool = True
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint under ``OUT/checkpoints`` that verifies (None when none
    does), and the newer ones that did not, each with why (:func:`verify_checkpoint`), newest
    first. Without ``fallback`` only the newest is tried: the result is it or ``(None, [(it,
    why)])``."""
    skipped: list[tuple[Path, str]] = []
    # A step folder without COMPLETE.json is skipped too, and named: it should not exist (a
    # save renames its folder only once complete), so someone took the marker away.
    for _, path in reversed(_step_folders(Path(out))):
        reason = verify_checkpoint(path)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
        if not fallback:
            break
    return None, skipped


def _relative(path: Path, out: Path) -> str:
    try:
        return path.relative_to(out).as_posix()
    except ValueError:
        return str(path)


def describe_fallback(
    out: str | Path, skipped: Sequence[tuple[Path, str]], chosen: Path, doing: str
) -> str:
    """One line on what :func:`verified_checkpoint` skipped and what it chose, paths relative to
    ``out``: ``skipped checkpoints/step_000030 (why); {doing} checkpoints/step_000020``."""
    out = Path(out)
    passed = ", ".join(f"{_relative(path, out)} ({reason})" for path, reason in skipped)
    return f"skipped {passed}; {doing} {_relative(chosen, out)}"


def resume_checkpoint(out: str | Path, *, strict: bool) -> tuple[Path | None, str | None]:
    """The checkpoint a ``--resume`` of ``out`` starts from (None: there is none, start at step
    0) and the one line to print when newer ones were skipped. ``ValueError`` when ``strict``
    and the newest does not verify, or when none does."""
    if not _step_folders(Path(out)):
        return None, None
    ckpt, skipped = verified_checkpoint(out, fallback=not strict)
    if ckpt is None:
        if strict:
            (path, reason), *_ = skipped
            raise ValueError(
                f"--strict-resume: checkpoint {str(path)!r} does not verify ({reason}); "
                f"without --strict-resume the run falls back to the newest one that does"
            )
        named = "; ".join(f"{str(path)!r} could not be read ({why})" for path, why in skipped[:3])
        more = f"; and {len(skipped) - 3} older" if len(skipped) > 3 else ""
        raise ValueError(
            f"cannot resume: no checkpoint in {str(out)!r} verifies: {named}{more}; restore "
            f"them, or move them away to start from step 0"
        )
    line = f"resume: {describe_fallback(out, skipped, ckpt, 'resuming from')}" if skipped else None
    return ckpt, line


def resolve_checkpoint(path: str | Path, *, log: Callable[[str], None] | None = None) -> Path:
    """A checkpoint folder itself, or the newest complete one of a run folder (``--out``) that
    verifies (:func:`verified_checkpoint`; ``log`` gets the line on what was skipped, if any).
    ``ValueError`` when the checkpoint, or every checkpoint of the run folder, fails to
    verify."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        reason = verify_checkpoint(path)
        if reason is not None:
            raise ValueError(f"checkpoint {str(path)!r} does not verify ({reason})")
        return path
    if path.is_dir():
        chosen, skipped = verified_checkpoint(path)
        if chosen is not None:
            if skipped and log is not None:
                log(describe_fallback(path, skipped, chosen, "using"))
            return chosen
        if skipped:
            raise ValueError(
                f"no checkpoint of {str(path)!r} verifies: "
                + "; ".join(f"{_relative(p, path)} ({reason})" for p, reason in skipped)
            )
    raise ValueError(
        f"{str(path)!r} is neither a complete checkpoint (a folder with {COMPLETE}) nor a run "
        f"folder that has one under {CHECKPOINTS}/"
    )


def free_space(out: str | Path) -> tuple[Path, int]:
    """The nearest existing folder of ``out`` (a run creates the rest) and the bytes free on
    its file system."""
    where = Path(out).resolve()
    while not where.exists():
        where = where.parent
    return where, shutil.disk_usage(where).free


def check_out_dir(out: str | Path, *, resume: bool, overwrite: bool) -> list[Path]:
    """May a run use ``out``? ``ValueError`` if not; else what ``overwrite`` must delete first.

    A non-empty folder is refused unless the run resumes it, or ``overwrite`` replaces the
    previous run's outputs - and only those: a folder holding anything else is refused, so
    nothing of the user's is ever deleted."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a folder")
    # The lock is this job's (the launcher took it before this check), never a run's output.
    entries = sorted(p for p in out.iterdir() if p.name != LOCK) if out.is_dir() else []
    if not entries:
        return []
    if resume:
        check_no_links(out)
        return []
    if not overwrite:
        raise ValueError(
            f"output folder {str(out)!r} is not empty; pass --resume to continue that run or "
            f"--overwrite to replace it"
        )
    foreign = [p.name for p in entries if p.name not in OUTPUTS]
    if foreign:
        raise ValueError(
            f"--overwrite refused: {str(out)!r} holds files a training run did not write "
            f"({', '.join(foreign[:5])}); choose another --out"
        )
    return entries


def prepare_out_dir(out: str | Path, *, resume: bool, overwrite: bool) -> None:
    """:func:`check_out_dir`, then delete what it allows and create the folder."""
    for target in check_out_dir(out, resume=resume, overwrite=overwrite):
        remove_entry(target)
    Path(out).mkdir(parents=True, exist_ok=True)
