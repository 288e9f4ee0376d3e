"""Checkpoints of a training run with DCP: atomic, resumable at any world size, exportable.

Saved with ``torch.distributed.checkpoint``, resumable at any world size and shard policy,
exportable to a plain ``state_dict`` ([Note: the life of a checkpoint] at :func:`save_checkpoint`).
How optimizer state reshards is in :mod:`raggedfsdp.checkpoint` ([Note: optimizer state across world
sizes]).
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._console import check_writable, write_whole
from ..checkpoint import (
    expected_entries,
    init_optimizer_state,
    load_optim_state_dict,
    optim_state_dict,
)
from ..runtime import error_feedback_state, load_error_feedback_state
from ..tensor import RaggedTensor
from .dcp_reader import SafeReader, read_metadata
from .run_dir import (
    COMPLETE,
    COMPLETE_KEYS,
    checkpoint_files,
    checkpoint_path,
    remove_entry,
    resolve_checkpoint,
    sign_record,
    verify_checkpoint,
)

__all__ = [
    "check_entries",
    "check_rank_files",
    "describe_failure",
    "export_checkpoint",
    "load_checkpoint",
    "load_full",
    "read_meta",
    "save_checkpoint",
    "verify_checkpoint",
]

#: 1: no records of the files; 2: ``files``, their sizes and checksums.
_FORMAT_VERSION = 2


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``COMPLETE.json`` of a checkpoint; ``ValueError`` when missing or corrupt."""
    file = Path(path) / COMPLETE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete: it has no {COMPLETE}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {str(path)!r}: {COMPLETE} is corrupt ({err})") from None
    required = set(COMPLETE_KEYS)
    if not isinstance(meta, dict) or not required <= meta.keys():
        raise ValueError(
            f"checkpoint {str(path)!r}: {COMPLETE} lacks "
            f"{sorted(required - set(meta)) if isinstance(meta, dict) else 'everything'}"
        )
    return meta


def _read_metadata(path: Path) -> Metadata:
    try:
        return read_metadata(path)
    except ValueError:  # a crafted file, refused (dcp_reader): its own line
        raise
    except Exception as err:  # DCP raises whatever its reader hit (OSError, pickle errors, ...)
        raise ValueError(
            f"checkpoint {str(path)!r} is corrupt: its DCP metadata cannot be read "
            f"({describe_failure(err)})"
        ) from None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def describe_failure(err: BaseException) -> str:
    """``Type: first line`` of what went wrong; for DCP's CheckpointException (which carries
    every failing rank's exception and traceback), that of the first failing rank."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank = min(err.failures)
        inner = err.failures[rank][0]
        return f"rank {rank}: {type(inner).__name__}: {_first_line(inner)}"
    return f"{type(err).__name__}: {_first_line(err)}"


# ---------------------------------------------------------------------------------------------
# Checking a checkpoint against what a run expects.


def check_entries(
    path: str | Path, expected: Mapping[str, tuple[int, ...] | None], meta: Mapping[str, Any]
) -> None:
    """``ValueError`` naming the first entry this run needs that the checkpoint lacks or holds
    in another shape (``None``: any non-tensor value)."""
    entries = _read_metadata(Path(path)).state_dict_metadata
    saved = meta.get("config", {})
    model = saved.get("hf_config") or saved.get("model")
    origin = f"saved by model {model!r} with optimizer {saved.get('optimizer')!r}"
    for key, shape in expected.items():
        if key not in entries:
            raise ValueError(
                f"checkpoint {str(path)!r} has no entry {key!r} ({origin}; incompatible with "
                f"this run)"
            )
        stored = entries[key]
        if shape is not None:
            if not isinstance(stored, TensorStorageMetadata):
                raise ValueError(f"checkpoint {str(path)!r}: entry {key!r} is not a tensor")
            if tuple(stored.size) != tuple(shape):
                raise ValueError(
                    f"checkpoint {str(path)!r}: entry {key!r} has shape {list(stored.size)}, "
                    f"this run expects {list(shape)} ({origin})"
                )


# ---------------------------------------------------------------------------------------------
# Save and load.


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _write_rng_state(path: Path) -> None:
    """This rank's RNG states to ``path``. Serialised in memory first (a few KB): torch.save
    straight to a full disk fails with an opaque RuntimeError; Python's write says ENOSPC."""
    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    path.write_bytes(buffer.getvalue())


def _load_weights(file: Path) -> Any:
    """A per-rank file of a checkpoint (RNG states: tensors and Python's state, tuples of
    ints; error-feedback residuals: tensors) read with ``weights_only``, so a crafted one runs
    nothing: ``ValueError`` naming the file and what it refused."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message opens with advice to load it unsafely; the refused global is inside.
        found = re.search(r"unsupported GLOBAL ([^ ]+)", str(err))
        why = f"it names the type {found.group(1)}" if found else _first_line(err)
        raise ValueError(
            f"checkpoint file {str(file)!r} refused: {why}, which torch.load(weights_only=True) "
            f"does not run (a crafted or foreign file)"
        ) from None


def check_rank_files(path: str | Path) -> None:
    """Read every rank's RNG states of the checkpoint ``path`` as a resume will (a few KB
    each), so that a crafted one is refused before any worker starts."""
    for file in sorted((Path(path) / "rng").glob("rank_*.pt")):
        _load_weights(file)


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# [Note: the life of a checkpoint] ``save_checkpoint`` writes into
# ``OUT/checkpoints/step_000123.tmp/``: DCP's files (model and optimizer, one file per rank plus
# ``.metadata``), one ``rng/rank_00000.pt`` per rank and, under compression with error feedback, one
# ``residuals/rank_00000.pt`` per rank. After a barrier (every rank has written), rank 0 writes
# ``COMPLETE.json`` (step, world size, config, data position, and the size and sha256 of every other
# file of the folder: the files of all ranks are on a shared file system, so rank 0 reads them),
# then renames the folder to ``step_000123/`` and fsyncs the parent. A rename is atomic, so a crash
# at any point leaves either a complete checkpoint or a ``.tmp`` folder, which
# :func:`latest_checkpoint` ignores and :func:`remove_partial` deletes. ``--resume`` loads the
# newest complete one that verifies (its files are still what ``COMPLETE.json`` recorded: [Note:
# checkpoints verify themselves] in :mod:`.run_dir`), and names what it skipped; ``--strict-resume``
# refuses instead of skipping.
def save_checkpoint(
    out: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: Mapping[str, Any],
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Save a checkpoint of ``step`` atomically (module Note); a collective. ``meta`` goes into
    ``COMPLETE.json`` (with ``step``, ``world_size``, the time and the size and checksum of every
    file, which rank 0 reads back: the collective lasts as long as that); ``before_commit`` runs on
    every rank after its files are written and before the checkpoint is made complete (a place
    for fault injection in tests). Returns the final folder."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    final = checkpoint_path(out, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        remove_entry(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # fails on anything planted since (a link): never written through
        (tmp / "rng").mkdir()
    _barrier()
    state = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    _write_rng_state(tmp / "rng" / f"rank_{rank:05d}.pt")
    _write_residuals(tmp, model, rank)
    if before_commit is not None:
        before_commit()
    _barrier()  # every rank's files are on disk
    if rank == 0:
        record = sign_record(
            {
                "version": _FORMAT_VERSION,
                **meta,
                "step": step,
                "world_size": world,
                "time": time.time(),
                "files": checkpoint_files(tmp),
            }
        )
        marker = tmp / COMPLETE
        with open(marker, "w") as f:
            json.dump(record, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a run resumed before it)
            _make_room(final, meta.get("job"))
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    _barrier()  # nobody moves on (or exits) before the checkpoint is complete
    return final


def _make_room(final: Path, job: object) -> None:
    """Clear the way for a checkpoint of a step saved before (``job``: this job's key, as
    ``meta`` records it). Only this job's own is replaced. Another job's is never: a damaged one
    (which ``--resume`` skipped) is moved aside, as ``step_N.unverified``; an intact one means
    that another job writes into this folder (past the run-folder lock: a bare torchrun, ...),
    and the save is refused."""
    try:
        written_by = json.loads((final / COMPLETE).read_text()).get("job")
    except (OSError, ValueError, AttributeError):  # no record, or not a readable one
        written_by = None
    if job is not None and written_by == job:
        shutil.rmtree(final)
        return
    if verify_checkpoint(final) is None:
        raise ValueError(
            f"checkpoint {str(final)!r} exists, written by another job "
            f"({written_by or 'unknown'}): not replacing it; is another job using this --out?"
        )
    aside = final.with_name(f"{final.name}.unverified")
    for n in itertools.count(2):
        if not aside.exists():
            break
        aside = final.with_name(f"{final.name}.unverified{n}")
    os.rename(final, aside)
    print(f"checkpoint: moved the damaged {final} aside, to {aside.name}", flush=True)


def _drop_unsaved_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, optim: dict[str, Any]
) -> None:
    """Forget the template's optimizer state (``optim``, by parameter name) of each parameter
    whose state the checkpoint holds none of: a parameter that had no gradient in any step
    before the save (a vision tower before the first image, a layer the model never uses), whose
    optimizer made no state, as it has none in an uninterrupted run (a zero state would count a
    step its first real update has not had)."""
    saved = _read_metadata(path).state_dict_metadata
    params = dict(model.named_parameters())
    for fqn in list(optim):
        keys = [key for key, _ in expected_entries(optim[fqn], f"optim.{fqn}.")]
        if not any(key in saved for key in keys):
            del optim[fqn]
            optimizer.state.pop(params[fqn], None)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint saved at any world size, mesh and shard policy into ``model`` and
    ``optimizer`` (a collective); returns its ``COMPLETE.json``. This rank's RNG states (and
    error-feedback residuals) are restored when the world size and the mesh are the ones saved
    (elsewhere ranks do not correspond). ``mesh``: this run's degrees, as its ``COMPLETE.json``
    records them (``{"dp": 2, "tp": 2}``); default FSDP alone over the world."""
    path = Path(path)
    meta = read_meta(path)
    init_optimizer_state(model, optimizer)
    state = {
        "model": _plain_targets(model.state_dict()),
        "optim": optim_state_dict(model, optimizer),
    }
    _drop_unsaved_state(path, model, optimizer, state["optim"])
    check_entries(path, dict(expected_entries(state)), meta)
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)))
    # DCP gathers every rank's failure into a CheckpointException, a BaseException.
    except (Exception, dcp.CheckpointException) as err:
        raise ValueError(
            f"checkpoint {str(path)!r} could not be read ({describe_failure(err)})"
        ) from None
    model.load_state_dict(state["model"])
    load_optim_state_dict(model, optimizer, state["optim"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved, now = _ranks_of(meta["world_size"], meta.get("mesh")), _ranks_of(world, mesh)
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if saved == now and rng_file.is_file():
        _set_rng_state(_load_weights(rng_file))
    _load_residuals(path, model, (meta["world_size"], saved), (world, now))
    return meta


def _plain_targets(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every sharded entry whose piece is a tensor subclass (the NF4 base of
    ``--base-weights nf4``) replaced by a plain piece of its shape to load into. DCP saves such
    a piece as its values (it reads the piece through a reshape, which a subclass computes) and
    would load into that computed copy, dropping what it read; the parameter then takes the
    values by its own ``copy_`` (NF4: quantized back to the same codes and scales) in
    ``load_state_dict``."""
    out = dict(state)
    for key, value in state.items():
        if not isinstance(value, RaggedTensor):
            continue
        piece = value.to_local()
        if type(piece) in (torch.Tensor, nn.Parameter):
            continue
        plain = torch.empty(piece.shape, dtype=piece.dtype, device=piece.device)
        out[key] = RaggedTensor.from_piece(
            plain,
            value.shard_layout,
            value.device_mesh,
            mesh_dim=value.shard_mesh_dim,
            placements=value.placements,
            shape=value.shape,
        )
    return out


def _ranks_of(world: int, mesh: Mapping[str, int] | None) -> dict[str, int]:
    """What rank ``r`` means: the world size and the mesh (a checkpoint from before meshes, or
    none given: FSDP alone over the world)."""
    return dict(mesh) if mesh else {"dp": world}


def _write_residuals(folder: Path, model: nn.Module, rank: int) -> None:
    """This rank's error-feedback residuals, when it keeps any (they are per rank, like the
    RNG states: what quantizing its own gradients dropped)."""
    residuals = error_feedback_state(model)
    if residuals:
        (folder / "residuals").mkdir(exist_ok=True)
        torch.save(residuals, folder / "residuals" / f"rank_{rank:05d}.pt")


def _load_residuals(
    path: Path,
    model: nn.Module,
    saved: tuple[int, dict[str, int]],
    now: tuple[int, dict[str, int]],
) -> None:
    """Resume the residuals at the world size and mesh (``(world, mesh)`` each) they were saved
    at; elsewhere they describe other ranks' gradients, so they restart from zero, with a
    warning."""
    if not error_feedback_state(model):
        return
    file = path / "residuals" / f"rank_{_rank():05d}.pt"
    if saved[0] != now[0]:
        warnings.warn(
            f"checkpoint {str(path)!r} was saved at world size {saved[0]}; resuming at "
            f"{now[0]}, the error-feedback residuals are dropped and restart from zero",
            stacklevel=2,
        )
    elif saved[1] != now[1]:
        warnings.warn(
            f"checkpoint {str(path)!r} was saved on the mesh {saved[1]}; resuming on {now[1]}, "
            f"the error-feedback residuals are dropped and restart from zero",
            stacklevel=2,
        )
    elif not file.is_file():
        warnings.warn(
            f"checkpoint {str(path)!r} has no error-feedback residuals (saved without error "
            f"feedback); they start from zero",
            stacklevel=2,
        )
    else:
        load_error_feedback_state(model, _load_weights(file))


def load_full(path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor entry of a checkpoint under ``prefix`` as a full tensor on CPU, keys without
    the prefix; one process, no process group needed."""
    path = Path(path)
    entries = _read_metadata(path).state_dict_metadata
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in entries.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"checkpoint {str(path)!r} has no entries under {prefix!r}")
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming single process": exactly the intent.
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=True)
        except (Exception, dcp.CheckpointException) as err:
            raise ValueError(
                f"checkpoint {str(path)!r} could not be read ({describe_failure(err)})"
            ) from None
    return {key.removeprefix(prefix): value for key, value in state.items()}


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def export_checkpoint(
    checkpoint: str | Path,
    out_file: str | Path,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] = _to_stderr,
) -> list[Path]:
    """Write the model of a checkpoint (or of a run folder's newest one that verifies) as a
    plain state dict of the unwrapped model: ``out_file`` ending in ``.safetensors`` in that
    format alone, any other name with ``torch.save`` and a ``.safetensors`` beside it when the
    package is installed. Checked by loading it into the model on the meta device. ``log`` gets
    one line when newer checkpoints of the run folder were skipped. Returns the files.

    Where the files go is checked before anything is read (``ValueError``: a folder, an
    existing file unless ``overwrite``, a parent that is a file or not writable); each is
    written to a temporary file beside it and renamed, so a failure (``OSError``: a full disk)
    leaves no part of it, nor the other file of the two."""
    from ..models import GPT_CONFIGS
    from .build import new_model_of

    targets = _export_targets(Path(out_file), overwrite=overwrite)
    path = resolve_checkpoint(checkpoint, log=lambda line: log(f"export: {line}"))
    meta = read_meta(path)
    hf_config = meta["config"].get("hf_config")
    name = hf_config or meta["config"].get("model")
    if hf_config is None and name not in GPT_CONFIGS:
        raise ValueError(f"checkpoint {str(path)!r} was saved by an unknown model {name!r}")
    state = load_full(path, "model.")
    # the config the checkpoint carries (older ones: the path or name it was trained from)
    record = meta.get("hf_config_record", hf_config)
    model = new_model_of(meta["config"].get("model"), record, "meta", lora=meta["config"])
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit model {name!r}: {' '.join(str(err).split())}"
        ) from None
    written: list[Path] = []
    try:
        for target in targets:
            _write_state(target, state)
            written.append(target)
    except OSError:
        for target in written:  # all or nothing: the torch.save file without its twin
            target.unlink(missing_ok=True)
        raise
    return targets


def _export_targets(out_file: Path, *, overwrite: bool) -> list[Path]:
    """The files an export to ``out_file`` writes, once each is known to be writable there."""
    tensors = importlib.util.find_spec("safetensors") is not None
    if out_file.suffix == ".safetensors":
        if not tensors:
            raise ValueError(
                f"export: {str(out_file)!r} needs the safetensors package (pip install "
                f"safetensors); or give a file name for torch.save, such as model.pt"
            )
        targets = [out_file]
    else:
        targets = [out_file, out_file.with_suffix(".safetensors")] if tensors else [out_file]
    for target in targets:
        check_writable(target, "export: --out")
        if target.exists() and not overwrite:
            raise ValueError(f"export: {str(target)!r} exists; pass --overwrite to replace it")
    return targets


def _write_state(target: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` at ``target``, whole or not at all: safetensors by its suffix, else
    torch.save."""
    if target.suffix == ".safetensors":
        from safetensors.torch import save_file

        def write(path: Path) -> None:
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))

    else:

        def write(path: Path) -> None:
            with open(path, "wb") as f:  # a file object: torch.save to a path hides ENOSPC
                torch.save(state, f)

    write_whole(target, write)
