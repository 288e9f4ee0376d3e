"""Checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP): atomic, resumable at
any world size and shard policy, exportable to a plain ``state_dict``.

[Note: the life of a checkpoint]
``save_checkpoint`` writes into ``OUT/checkpoints/step_000123.tmp/``: DCP's files (model and
optimizer, one file per rank plus ``.metadata``) and one ``rng/rank_00000.pt`` per rank. After a
barrier (every rank has written), rank 0 writes ``COMPLETE.json`` (step, world size, config, data
position), then renames the folder to ``step_000123/`` and fsyncs the parent. A rename is atomic,
so a crash at any point leaves either a complete checkpoint or a ``.tmp`` folder, which
:func:`latest_checkpoint` ignores and :func:`remove_partial` deletes. ``--resume`` loads the
newest complete one.

[Note: optimizer state across world sizes]
The optimizer's state is keyed by parameter FQN and made of DCP-reshardable values
(:func:`optim_state_dict`); which values are sharded how is decided per state entry:

1. the optimizer may say: ``optimizer.sharded_state_layout(param, key, value)`` returns the
   :class:`ShardLayout` of ``value`` (a tensor, or a list of tensors taken as the concatenation of
   their flattenings), or ``None`` to fall through. This is how block-structured state (8-bit
   scales, Shampoo's per-block factors) reshards: the optimizer knows the global tensor its
   local blocks belong to;
2. a 0-D tensor (``step``) is a plain, replicated tensor;
3. state of an unsharded parameter (no :func:`shard_info`) is plain, held whole by every rank;
4. a tensor with as many elements as the parameter's local shard is *param-shaped*: it is sharded
   exactly as the parameter (the parameter's layout);
5. a non-tensor value (a Python number) is stored as is (replicated);
6. anything else is an error naming the optimizer, the parameter and the key.

Loading at another world size or policy needs a *template*: the new run's own state, in its own
layout, for DCP to fill. :func:`init_optimizer_state` creates it by one optimizer step with zero
gradients and every learning rate set to 0, after which the parameters are restored from a copy
(so whatever the update rule does with a zero step, the model is untouched); DCP then overwrites
every value of that template with the saved one, resharded.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .checkpoint import to_sharded_tensor
from .layout import ShardLayout, shard_info

__all__ = [
    "CHECKPOINTS",
    "COMPLETE",
    "OUTPUTS",
    "check_entries",
    "check_out_dir",
    "checkpoint_path",
    "export_checkpoint",
    "init_optimizer_state",
    "latest_checkpoint",
    "load_checkpoint",
    "load_full",
    "load_optim_state_dict",
    "optim_state_dict",
    "prepare_out_dir",
    "read_meta",
    "remove_partial",
    "resolve_checkpoint",
    "save_checkpoint",
]

#: Folder of the checkpoints inside ``--out``.
CHECKPOINTS = "checkpoints"
#: The marker (and metadata) that makes a checkpoint folder complete.
COMPLETE = "COMPLETE.json"
#: Everything a training run writes into ``--out``; ``--overwrite`` deletes only these.
OUTPUTS = (CHECKPOINTS, "metrics.jsonl", "report.png", "config.json", "tensorboard", ".faults")

_STEP_DIR = re.compile(r"^step_(\d+)$")
_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Folders.


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


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``COMPLETE.json`` of a checkpoint; ``ValueError`` when missing or corrupt."""
    file = Path(path) / COMPLETE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete: it has no {COMPLETE}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {str(path)!r}: {COMPLETE} is corrupt ({err})") from None
    required = {"step", "world_size", "config", "data"}
    if not isinstance(meta, dict) or not required <= meta.keys():
        raise ValueError(
            f"checkpoint {str(path)!r}: {COMPLETE} lacks "
            f"{sorted(required - set(meta)) if isinstance(meta, dict) else 'everything'}"
        )
    return meta


def _read_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # DCP raises whatever its reader hit (OSError, pickle errors, ...)
        raise ValueError(
            f"checkpoint {str(path)!r} is corrupt: its DCP metadata cannot be read ({_cause(err)})"
        ) from None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _cause(err: BaseException) -> str:
    """``Type: first line`` of what went wrong; for DCP's CheckpointException (which carries
    every failing rank's exception and traceback), that of the first failing rank."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank = min(err.failures)
        inner = err.failures[rank][0]
        return f"rank {rank}: {type(inner).__name__}: {_first_line(inner)}"
    return f"{type(err).__name__}: {_first_line(err)}"


# ---------------------------------------------------------------------------------------------
# Optimizer state.


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _state_items(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
    """``(fqn, param, state)`` for every parameter of ``optimizer`` that has state."""
    names = _param_names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter of shape {list(p.shape)} that "
                    f"is not a parameter of the model"
                )
            state = optimizer.state.get(p)
            if state:
                yield names[id(p)], p, state


def _flat(value: torch.Tensor | list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A state value as one flat local tensor: a view of a tensor, or the concatenation of a
    list's flattenings (a new tensor; an empty list is an empty float32 tensor on ``device``)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)
    if not value:
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.cat([v.reshape(-1) for v in value])


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)


def _entry(
    optimizer: torch.optim.Optimizer, fqn: str, param: torch.Tensor, key: str, value: Any
) -> Any:
    """One state value as DCP should store it (rules in the module's Note)."""
    info = shard_info(param)
    if info is None:  # rule 3 (and 2, 5): this process holds the whole parameter and its state
        return value
    hook: Callable[..., ShardLayout | None] | None = getattr(
        optimizer, "sharded_state_layout", None
    )
    layout = hook(param, key, value) if hook is not None else None
    if layout is not None:
        flat = _flat(value, param.device)
        if flat.numel() != layout.local_numel(info.rank):
            raise ValueError(
                f"{type(optimizer).__name__}.sharded_state_layout gave state {key!r} of "
                f"parameter {fqn!r} a layout with {layout.local_numel(info.rank)} elements on "
                f"rank {info.rank}, but the value has {flat.numel()}"
            )
        return to_sharded_tensor(flat, layout, info.rank, info.group)
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value
    if info.layout.ndim == 0:
        raise ValueError(
            f"{type(optimizer).__name__} state {key!r} of the 0-D parameter {fqn!r} cannot be "
            f"checkpointed (it lives on one rank; its scalar state is ambiguous)"
        )
    if isinstance(value, torch.Tensor) and value.numel() == info.layout.local_numel(info.rank):
        if not value.is_contiguous():
            value = value.contiguous()  # a copy: loading then copies back into the state
        return to_sharded_tensor(value, info.layout, info.rank, info.group)
    if not isinstance(value, (torch.Tensor, list, tuple, dict)):
        return value
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"cannot checkpoint {type(optimizer).__name__} state {key!r} of parameter {fqn!r}: "
        f"it is {shape}, neither shaped like the parameter's local shard "
        f"({info.layout.local_numel(info.rank)} elements) nor a scalar, and the optimizer "
        f"defines no sharded_state_layout(param, key, value) saying how it is sharded"
    )


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{fqn: {state key: value}}`` with DCP-reshardable values (module Note). Tensor values are
    views of the optimizer's state (no copy), except lists, which are concatenated."""
    return {
        fqn: {key: _entry(optimizer, fqn, p, key, value) for key, value in state.items()}
        for fqn, p, state in _state_items(model, optimizer)
    }


def _local_flat(value: ShardedTensor) -> torch.Tensor:
    """This rank's piece of a ShardedTensor built by :func:`to_sharded_tensor`: its local shards
    are row-major runs of the rank's flat range, so concatenating them gives the piece back."""
    shards = value.local_shards()
    if not shards:
        return torch.empty(0, dtype=value.dtype)
    return torch.cat([s.tensor.reshape(-1) for s in shards])


def _same_storage(value: ShardedTensor, target: torch.Tensor) -> bool:
    ptr = target.untyped_storage().data_ptr()
    return all(s.tensor.untyped_storage().data_ptr() == ptr for s in value.local_shards())


def load_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Put ``state`` (an :func:`optim_state_dict` of this optimizer, filled by ``dcp.load``) into
    the optimizer. Values DCP loaded in place are left alone; the others are copied in."""
    for fqn, _param, current in _state_items(model, optimizer):
        if fqn not in state:
            raise ValueError(f"optimizer state has no entry for parameter {fqn!r}")
        for key, target in list(current.items()):
            if key not in state[fqn]:
                raise ValueError(f"optimizer state of {fqn!r} has no {key!r}")
            loaded = state[fqn][key]
            if isinstance(loaded, ShardedTensor):
                if isinstance(target, torch.Tensor) and _same_storage(loaded, target):
                    continue
                flat = _local_flat(loaded)
                pieces = [target] if isinstance(target, torch.Tensor) else list(target)
                position = 0
                for piece in pieces:
                    piece.copy_(flat[position : position + piece.numel()].view_as(piece))
                    position += piece.numel()
            elif isinstance(loaded, torch.Tensor) and isinstance(target, torch.Tensor):
                if loaded.data_ptr() != target.data_ptr():
                    target.copy_(loaded)
            elif _is_tensor_list(loaded) and _is_tensor_list(target):
                for piece, value in zip(target, loaded, strict=True):
                    piece.copy_(value)
            else:
                current[key] = loaded


@torch.no_grad()
def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (in the current layout) without changing the model: one step
    with zero gradients and learning rate 0, then the parameters restored bit for bit. A
    collective when the optimizer's step is (every rank must call it)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for p, value, grad in zip(params, saved, grads, strict=True):
            p.copy_(value)
            p.grad = grad
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


# ---------------------------------------------------------------------------------------------
# Checking a checkpoint against what a run expects.


def _expected_shapes(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(DCP key, shape or None)`` of a nested state dict, keys flattened as DCP does."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _expected_shapes(value, f"{name}.")
        elif isinstance(value, ShardedTensor):
            yield name, tuple(value.size())
        elif isinstance(value, torch.Tensor):
            yield name, tuple(value.shape)
        elif _is_tensor_list(value):
            for i, item in enumerate(value):
                yield f"{name}.{i}", tuple(item.shape)
        else:
            yield name, None


def check_entries(
    path: str | Path, expected: Mapping[str, tuple[int, ...] | None], meta: Mapping[str, Any]
) -> None:
    """``ValueError`` naming the first entry this run needs that the checkpoint lacks or holds
    in another shape (``None``: any non-tensor value)."""
    entries = _read_metadata(Path(path)).state_dict_metadata
    saved = meta.get("config", {})
    origin = f"saved by model {saved.get('model')!r} with optimizer {saved.get('optimizer')!r}"
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


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    ``COMPLETE.json`` (with ``step``, ``world_size`` and the time); ``before_commit`` runs on
    every rank after its files are written and before the checkpoint is made complete (a place
    for fault injection in tests). Returns the final folder."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    final = checkpoint_path(out, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    state = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if before_commit is not None:
        before_commit()
    _barrier()  # every rank's files are on disk
    if rank == 0:
        record = {
            "version": _FORMAT_VERSION,
            **meta,
            "step": step,
            "world_size": world,
            "time": time.time(),
        }
        marker = tmp / COMPLETE
        with open(marker, "w") as f:
            json.dump(record, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a run resumed before it)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    _barrier()  # nobody moves on (or exits) before the checkpoint is complete
    return final


def load_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load a checkpoint saved at any world size and shard policy into ``model`` and
    ``optimizer`` (a collective); returns its ``COMPLETE.json``. This rank's RNG states are
    restored when the world size is the one saved (elsewhere ranks do not correspond)."""
    path = Path(path)
    meta = read_meta(path)
    init_optimizer_state(model, optimizer)
    state = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
    check_entries(path, dict(_expected_shapes(state)), meta)
    try:
        dcp.load(state, checkpoint_id=str(path))
    # DCP gathers every rank's failure into a CheckpointException, a BaseException.
    except (Exception, dcp.CheckpointException) as err:
        raise ValueError(f"checkpoint {str(path)!r} could not be read ({_cause(err)})") from None
    model.load_state_dict(state["model"])
    load_optim_state_dict(model, optimizer, state["optim"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if meta["world_size"] == world and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


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
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
        except (Exception, dcp.CheckpointException) as err:
            raise ValueError(
                f"checkpoint {str(path)!r} could not be read ({_cause(err)})"
            ) from None
    return {key.removeprefix(prefix): value for key, value in state.items()}


def export_checkpoint(checkpoint: str | Path, out_file: str | Path) -> list[Path]:
    """Write the model of a checkpoint (or of a run folder's newest one) as a plain
    ``torch.save`` state dict of the unwrapped model, plus ``.safetensors`` when the package is
    installed. Checked by loading it into the model on the meta device. Returns the files."""
    from .models import GPT, GPT_CONFIGS

    path = resolve_checkpoint(checkpoint)
    meta = read_meta(path)
    name = meta["config"].get("model")
    if name not in GPT_CONFIGS:
        raise ValueError(f"checkpoint {str(path)!r} was saved by an unknown model {name!r}")
    state = load_full(path, "model.")
    try:
        GPT(GPT_CONFIGS[name], device="meta").load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit model {name!r}: {' '.join(str(err).split())}"
        ) from None
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_file)
    written = [out_file]
    try:
        from safetensors.torch import save_file
    except ImportError:  # optional dependency
        return written
    tensors_file = out_file.with_suffix(".safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tensors_file))
    written.append(tensors_file)
    return written
