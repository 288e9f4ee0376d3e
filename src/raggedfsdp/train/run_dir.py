"""The run's output folder (``--out``): what a run writes there, which checkpoints are complete,
and whether a new run may use the folder."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = [
    "CHECKPOINTS",
    "COMPLETE",
    "OUTPUTS",
    "check_out_dir",
    "checkpoint_path",
    "latest_checkpoint",
    "prepare_out_dir",
    "remove_partial",
    "resolve_checkpoint",
]

#: Folder of the checkpoints inside ``--out``.
CHECKPOINTS = "checkpoints"
#: The marker (and metadata) that makes a checkpoint folder complete.
COMPLETE = "COMPLETE.json"
#: Everything a training run writes into ``--out``; ``--overwrite`` deletes only these.
OUTPUTS = (CHECKPOINTS, "metrics.jsonl", "report.png", "config.json", "tensorboard", ".faults")

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_path(out: str | Path, step: int) -> Path:
    """``OUT/checkpoints/step_000123`` (six digits, more when needed)."""
    return Path(out) / CHECKPOINTS / f"step_{step:06d}"


def _complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / COMPLETE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete checkpoint under ``OUT/checkpoints`` (``.tmp`` folders ignored)."""
    found = _complete_checkpoints(Path(out))
    return found[-1][1] if found else None


def remove_partial(out: str | Path) -> list[Path]:
    """Delete the ``.tmp`` folders of saves that never completed; returns them. Call on one rank
    while no save is in flight (at start-up)."""
    root = Path(out) / CHECKPOINTS
    removed = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the newest complete one of a run folder (``--out``)."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    raise ValueError(
        f"{str(path)!r} is neither a complete checkpoint (a folder with {COMPLETE}) nor a run "
        f"folder that has one under {CHECKPOINTS}/"
    )


def check_out_dir(out: str | Path, *, resume: bool, overwrite: bool) -> list[Path]:
    """May a run use ``out``? ``ValueError`` if not; else what ``overwrite`` must delete first.

    A non-empty folder is refused unless the run resumes it, or ``overwrite`` replaces the
    previous run's outputs - and only those: a folder holding anything else is refused, so
    nothing of the user's is ever deleted."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} exists and is not a folder")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if not entries or resume:
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
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    Path(out).mkdir(parents=True, exist_ok=True)
