"""Reading a checkpoint folder with DCP without running code that the folder holds.

:class:`SafeReader` is DCP's reader whose unpickler admits only the types DCP's metadata holds, so a
crafted file is refused before anything in it runs ([Note: checkpoints load no code] at
:class:`SafeReader`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["ALLOWED", "SafeReader", "read_metadata"]

_DCP = "torch.distributed.checkpoint.metadata"

#: ``(module, name)`` of every global a DCP ``.metadata`` may name: DCP's metadata dataclasses,
#: the storage records of its file system writer, ``torch.Size``, a layout by name and the
#: ``pathlib`` paths a ``StorageMeta`` records. Dtypes (``torch.float32``, ...) are admitted by
#: type, in :meth:`_MetadataUnpickler.find_class`.
ALLOWED = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _Refused(pickle.UnpicklingError):
    """A pickle named a global outside :data:`ALLOWED`."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of the checkpoint folder ``path``, unpickled with the allow-list of
    this module's Note. ``ValueError`` naming the file and the type a crafted one names; the
    errors of a damaged file (``OSError``, ``pickle.UnpicklingError``, ...) pass through."""
    return SafeReader(str(path)).read_metadata()


def _unpickle_metadata(file: Path) -> Metadata:
    with open(file, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except _Refused as err:
            raise ValueError(
                f"checkpoint file {str(file)!r} names the type {err}, which DCP metadata never "
                f"holds: refused, nothing of it was run (a crafted or foreign file)"
            ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(
            f"checkpoint file {str(file)!r} holds a {type(metadata).__name__}, not DCP metadata"
        )
    return metadata


# [Note: checkpoints load no code] DCP's ``.metadata`` is a pickle, and
# ``FileSystemReader.read_metadata`` unpickles it: a checkpoint copied from elsewhere could run any
# code in the process that reads it (the launcher's preflight, ``raggedfsdp export``, every worker's
# resume). :class:`SafeReader` is DCP's reader with one change, an unpickler whose ``find_class``
# admits only the types DCP's metadata holds (:data:`ALLOWED`, listed from torch 2.13's
# ``torch/distributed/checkpoint/metadata.py`` and what its ``FileSystemWriter`` stores beside
# them), so a crafted file is refused with a :class:`ValueError` naming the file and the type,
# before anything in it runs. Every read of a checkpoint in raggedfsdp goes through it
# (``dcp.load(..., storage_reader=SafeReader(path))``); the other files of a checkpoint are read
# with ``torch.load(..., weights_only=True)``.
class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` runs no code of the checkpoint (module
    Note); pass it as ``storage_reader`` to ``dcp.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _unpickle_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        # What FileSystemReader.read_metadata adds after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
