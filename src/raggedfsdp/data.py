"""Byte-level text data: a corpus loader and a world-size-independent batch sampler.

The default corpus is the Python standard library's own ``.py`` sources, which every machine with
Python has, so training runs need no download. (Its exact bytes depend on the Python version.)

Tokens are raw bytes (vocabulary 256). Files are joined with a NUL byte, which never occurs inside
them because files containing NUL are treated as binary and skipped; the model thus sees a
distinct document-boundary token.
"""

from __future__ import annotations

import math
import operator
import os
import random
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

import torch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "SEPARATOR",
    "BatchSampler",
    "Corpus",
    "default_corpus_files",
    "eval_batches",
    "generator_seed",
    "load_corpus",
    "sample_batch",
]

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
"""Default cap on the bytes read into a corpus (keeps start-up fast)."""

SEPARATOR = b"\x00"
"""Byte placed between two files in the token stream."""

# Multiplier that spreads (seed, step) pairs over generator seeds; documented in BatchSampler.
_SEED_STRIDE = 1_000_003
# XOR-ed into the generator seed of evaluation batches so they never coincide with a training
# batch of the same seed (that would take ~2.6e9 steps). It must live in the low 32 bits: torch's
# CPU generator (mt19937) keeps only the low 32 bits of its seed, so a salt above them is a no-op.
_EVAL_SALT = 0x9E37_79B9
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus split into training and validation streams.

    Attributes:
        train: uint8 1-D tensor of training tokens (bytes).
        val: uint8 1-D tensor of validation tokens (bytes).
        num_files: number of files read into ``train`` and ``val`` together.
        source: human-readable description of where the bytes came from.
    """

    train: torch.Tensor
    val: torch.Tensor
    num_files: int
    source: str


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, excluding ``site-packages``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _open_regular(path: Path) -> BinaryIO | None:
    """``path`` opened for reading when it is a regular file (judged on the open file, so it
    cannot change in between), else None: a FIFO or a device would block or never end.
    Opened without blocking, which a FIFO would do before its check."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _to_tensor(data: bytes) -> torch.Tensor:
    # frombuffer needs a writable buffer to hand out a tensor that may be written without warning.
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def load_corpus(
    path: str | Path | None,
    *,
    seed: int,
    val_fraction: float = 0.05,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Corpus:
    """Load a byte-level corpus and split it into train and validation by file.

    Args:
        path: a text file, a folder (every regular file below it, recursively; files with NUL
            bytes are skipped as binary, as are empty and unreadable ones, FIFOs and devices),
            or None for
            :func:`default_corpus_files`.
        seed: shuffles the sorted file list with ``random.Random(seed)``.
        val_fraction: share of files for validation, in (0, 1): the last
            ``ceil(val_fraction * n)`` shuffled files, at least one, and never all of them. A
            corpus of a single file is instead split by bytes: its first ``1 - val_fraction``
            go to train, the rest to validation.
        max_bytes: cap on the bytes read, or None for no cap. Files are taken in shuffled order
            while the total stays within the cap (the first file always, cut at the cap), so
            the cap is deterministic for a given seed; a file is never read past it. Applies
            to every source.

    Raises:
        ValueError: ``path`` does not exist, is an empty file, or is a folder with no readable
            text; bad ``val_fraction`` or ``max_bytes``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes!r}")
    files, source = _corpus_files(path)
    order = list(files)
    random.Random(seed).shuffle(order)
    chunks = _read_capped(order, max_bytes)
    if not chunks:
        _raise_no_text(path, source)
    train, val = _split(chunks, val_fraction, source)
    return Corpus(
        train=_to_tensor(train), val=_to_tensor(val), num_files=len(chunks), source=source
    )


def _corpus_files(path: str | Path | None) -> tuple[list[Path], str]:
    """The candidate files of ``path`` (see :func:`load_corpus`), sorted so the shuffle that
    follows depends on the seed only, and a description of the source for messages."""
    if path is None:
        files = default_corpus_files()
        source = f"Python standard library ({sysconfig.get_paths()['stdlib']})"
        if not files:
            raise ValueError(f"no .py files found in the standard library at {source}")
        return files, source
    root = Path(path)
    if not root.exists():
        raise ValueError(f"corpus path {str(root)!r} does not exist")
    if not root.is_dir() and not root.is_file():
        raise ValueError(f"corpus path {str(root)!r} is neither a regular file nor a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return files, str(root)


def _read_capped(order: list[Path], max_bytes: int | None) -> list[bytes]:
    """The non-empty text files of ``order`` (regular files only: :func:`_open_regular`),
    read in that order while the total stays within ``max_bytes``; the first one always, cut
    at the cap. A file's size decides before it is read, so no more than the cap is ever read:
    the stdlib is 30+ MB, a corpus file may be far larger, and start-up should not pay for
    bytes the cap then drops."""
    chunks: list[bytes] = []
    total = 0
    for file in order:
        opened = _open_regular(file)
        if opened is None:
            continue
        with opened as f:
            size = os.fstat(f.fileno()).st_size
            if size and max_bytes is not None and chunks and total + size > max_bytes:
                break
            data = f.read(size if max_bytes is None else min(size, max_bytes - total))
        if data and SEPARATOR not in data:  # NUL bytes: a binary file, skipped
            chunks.append(data)
            total += len(data)
    return chunks


def _raise_no_text(path: str | Path | None, source: str) -> NoReturn:
    """Raise the error for a source that gave no text, naming why when it is a single file
    (empty or binary), since that is what the user will want to fix."""
    if path is not None and Path(path).is_file():
        reason = "is empty" if Path(path).stat().st_size == 0 else "is not readable text"
        raise ValueError(f"corpus file {source!r} {reason}")
    raise ValueError(f"corpus folder {source!r} has no readable text files")


def _split(chunks: list[bytes], val_fraction: float, source: str) -> tuple[bytes, bytes]:
    """The train and validation bytes: by file (the last files to validation, at least one
    each side), or by bytes for a single file, which could not otherwise give both sides."""
    if len(chunks) == 1:
        data = chunks[0]
        if len(data) < 2:
            raise ValueError(f"corpus {source!r} is too small to split ({len(data)} byte)")
        cut = min(max(round(len(data) * (1.0 - val_fraction)), 1), len(data) - 1)
        return data[:cut], data[cut:]
    n_val = min(max(math.ceil(val_fraction * len(chunks)), 1), len(chunks) - 1)
    return SEPARATOR.join(chunks[:-n_val]), SEPARATOR.join(chunks[-n_val:])


def _check_tokens(tokens: torch.Tensor, seq_len: int) -> None:
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"token stream of {tokens.numel()} tokens is too short for seq_len={seq_len} "
            f"(needs at least {seq_len + 1})"
        )


def _check_split(batch: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's rows ``[lo, hi)`` of a batch of ``batch`` rows."""
    if batch <= 0:
        raise ValueError(f"global batch must be positive, got {batch}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if batch % world_size != 0:
        raise ValueError(f"global batch {batch} is not divisible by world size {world_size}")
    per_rank = batch // world_size
    return rank * per_rank, (rank + 1) * per_rank


def generator_seed(seed: int, step: int, *, split: str) -> int:
    """The seed of the generator that draws batch ``step`` of ``split`` (:func:`sample_batch`)."""
    value = seed * _SEED_STRIDE + step
    if split == "eval":
        value ^= _EVAL_SALT
    elif split != "train":
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    # torch.Generator.manual_seed takes a uint64; wrap negatives explicitly rather than rely on it.
    return value & _U64


def sample_batch(
    tokens: torch.Tensor,
    step: int,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    split: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[rank*b, (rank+1)*b)`` (``b = batch_size // world_size``) of batch ``step``.

    The whole ``batch_size``-row batch is a function of ``(seed, step, split)`` only: its start
    positions are drawn uniformly from a ``torch.Generator`` seeded with
    ``seed * 1_000_003 + step`` (XOR ``0x9E3779B9`` for ``split="eval"``, a separate stream),
    so every rank draws the same starts and keeps its own rows. Torch's CPU generator uses only
    the low 32 bits of that seed, so the stream of a seed repeats with period 2**32 in ``seed``.

    Returns:
        ``(x, y)``, int64 ``[b, seq_len]``, with ``y[i, t] == x[i, t + 1]`` along the stream.
    """
    _check_tokens(tokens, seq_len)
    lo, hi = _check_split(batch_size, rank, world_size)
    gen = torch.Generator().manual_seed(generator_seed(seed, step, split=split))
    # Valid starts s satisfy s + seq_len < numel, so that y's last token exists.
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=gen)[lo:hi]
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def eval_batches(
    tokens: torch.Tensor,
    num_batches: int,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches (this rank's rows), the same at every call.

    Drawn from the ``"eval"`` stream of :func:`sample_batch` at steps ``0..num_batches-1``, so
    evaluation never reuses a training batch and is comparable across runs and world sizes.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be non-negative, got {num_batches}")
    return [
        sample_batch(
            tokens,
            i,
            seq_len=seq_len,
            batch_size=global_batch,
            seed=seed,
            rank=rank,
            world_size=world_size,
            split="eval",
        )
        for i in range(num_batches)
    ]


class BatchSampler:
    """Random-window batches of a token stream, sliced for one data-parallel rank.

    The global batch at step ``k`` depends only on ``(seed, k)`` (see :func:`sample_batch`), never
    on ``rank`` or ``world_size``: the ranks' slices concatenate, in rank order, to the same global
    batch at every world size. A run checkpointed at step ``k`` and resumed at another world size
    (same ``seed`` and ``global_batch``) therefore follows the same data trajectory; the state to
    carry is just ``{"step": k}``.

    Args:
        tokens: 1-D token tensor (e.g. :attr:`Corpus.train`).
        seq_len: tokens per row of ``x``.
        global_batch: rows in the global batch; must be divisible by ``world_size``.
        seed: data seed.
        rank: this process's data-parallel rank.
        world_size: number of data-parallel ranks.

    Raises:
        ValueError: ``global_batch % world_size != 0``, a bad rank, or a stream shorter than
            ``seq_len + 1`` tokens.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        rank: int,
        world_size: int,
    ) -> None:
        _check_tokens(tokens, seq_len)
        _check_split(global_batch, rank, world_size)
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.step = 0

    @property
    def local_batch(self) -> int:
        """Rows per rank."""
        return self.global_batch // self.world_size

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)`` for the current step, then advance the step."""
        batch = sample_batch(
            self.tokens,
            self.step,
            seq_len=self.seq_len,
            batch_size=self.global_batch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.step += 1
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def eval_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed evaluation batches from this sampler's tokens (see :func:`eval_batches`)."""
        return eval_batches(
            self.tokens,
            num_batches,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
        )

    def state_dict(self) -> dict[str, int]:
        """``{"step": k}``: the next batch to be returned is batch ``k``."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state["step"]``."""
        raw = state["step"]
        try:
            # operator.index accepts numpy and 0-d tensor integers (as loaded checkpoints give).
            step = operator.index(raw)
        except TypeError:
            step = -1
        if isinstance(raw, bool) or step < 0:
            raise ValueError(f"sampler step must be a non-negative int, got {raw!r}")
        self.step = step
