"""Tests for raggedfsdp.data: corpus loading and the batch sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raggedfsdp.data import (
    SEPARATOR,
    BatchSampler,
    default_corpus_files,
    eval_batches,
    load_corpus,
)


def _make_folder(root: Path, n: int) -> Path:
    root.mkdir()
    for i in range(n):
        # Each file carries a unique marker so the split can be traced back to files.
        (root / f"f{i:02d}.txt").write_text(f"<file {i:02d}>" + "abc\n" * (20 + i))
    (root / "sub").mkdir()
    (root / "sub" / "blob.bin").write_bytes(b"binary\x00data")
    return root


def _markers(tokens: torch.Tensor) -> set[str]:
    text = bytes(tokens.tolist()).decode()
    return {part[:9] for part in text.split(SEPARATOR.decode())}


def test_default_corpus() -> None:
    files = default_corpus_files()
    assert files == sorted(files)
    assert files and all(f.suffix == ".py" for f in files)
    corpus = load_corpus(None, seed=0, max_bytes=256 * 1024)
    assert corpus.train.dtype == torch.uint8
    assert 0 < corpus.train.numel() + corpus.val.numel() <= 256 * 1024 + corpus.num_files
    assert corpus.val.numel() > 0


def test_corpus_deterministic_and_split_by_file(tmp_path: Path) -> None:
    folder = _make_folder(tmp_path / "docs", 20)
    a = load_corpus(folder, seed=3)
    b = load_corpus(folder, seed=3)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.num_files == 20  # the binary file is skipped
    train, val = _markers(a.train), _markers(a.val)
    assert len(val) == 1 and len(train) == 19  # ceil(0.05 * 20) == 1
    assert not train & val
    other = load_corpus(folder, seed=4, val_fraction=0.25)
    assert len(_markers(other.val)) == 5
    assert not torch.equal(load_corpus(folder, seed=4).train, a.train)


def test_corpus_cap(tmp_path: Path) -> None:
    folder = _make_folder(tmp_path / "docs", 20)
    capped = load_corpus(folder, seed=0, max_bytes=400)
    assert 2 <= capped.num_files < 20
    assert capped.train.numel() + capped.val.numel() <= 400 + capped.num_files


def test_single_file_split_by_bytes(tmp_path: Path) -> None:
    file = tmp_path / "one.txt"
    file.write_bytes(b"x" * 1000)
    corpus = load_corpus(file, seed=0)
    assert (corpus.train.numel(), corpus.val.numel()) == (950, 50)
    assert corpus.num_files == 1


def test_corpus_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    with pytest.raises(ValueError, match=r"missing\.txt"):
        load_corpus(missing, seed=0)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt.*is empty"):
        load_corpus(empty, seed=0)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no readable text"):
        load_corpus(folder, seed=0)


def _sampler(tokens: torch.Tensor, rank: int, world: int, seed: int = 7) -> BatchSampler:
    return BatchSampler(tokens, seq_len=16, global_batch=8, seed=seed, rank=rank, world_size=world)


TOKENS = torch.arange(1000, dtype=torch.int64).remainder(251).to(torch.uint8)


def test_sampler_shapes_and_shift() -> None:
    x, y = _sampler(TOKENS, 0, 2).next()
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_sampler_determinism_per_seed() -> None:
    a, b, c = _sampler(TOKENS, 0, 1), _sampler(TOKENS, 0, 1), _sampler(TOKENS, 0, 1, seed=8)
    for _ in range(3):
        xa, _ = a.next()
        xb, _ = b.next()
        xc, _ = c.next()
        assert torch.equal(xa, xb)
        assert not torch.equal(xa, xc)


@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_concatenate_to_global_batch(world: int) -> None:
    full = _sampler(TOKENS, 0, 1)
    ranks = [_sampler(TOKENS, r, world) for r in range(world)]
    for _ in range(3):
        x_full, y_full = full.next()
        parts = [s.next() for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x_full)
        assert torch.equal(torch.cat([p[1] for p in parts]), y_full)


def test_state_dict_resume_across_world_sizes() -> None:
    run = _sampler(TOKENS, 0, 1)
    for _ in range(5):
        run.next()
    state = run.state_dict()
    assert state == {"step": 5}
    expected, _ = run.next()
    resumed = [_sampler(TOKENS, r, 2) for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)
    assert torch.equal(torch.cat([s.next()[0] for s in resumed]), expected)
    with pytest.raises(ValueError, match="non-negative"):
        run.load_state_dict({"step": -1})


def test_eval_batches_fixed_and_distinct() -> None:
    sampler = _sampler(TOKENS, 0, 1)
    first = eval_batches(TOKENS, 2, seq_len=16, global_batch=8, seed=7)
    again = sampler.eval_batches(2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, again, strict=True))
    assert not torch.equal(first[0][0], sampler.next()[0])


def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match=r"global batch 6 .* world size 4"):
        BatchSampler(TOKENS, seq_len=16, global_batch=6, seed=0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="too short"):
        BatchSampler(TOKENS[:16], seq_len=16, global_batch=2, seed=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2"):
        BatchSampler(TOKENS, seq_len=16, global_batch=4, seed=0, rank=2, world_size=2)


def test_corpus_reads_regular_files_only(tmp_path: Path) -> None:
    """A FIFO given as ``--data`` is one clear error, at once (reading it would never end); one
    inside a folder is skipped, never opened for a blocking read."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="neither a regular file nor a folder"):
        load_corpus(fifo, seed=0)
    folder = _make_folder(tmp_path / "docs", 3)
    os.mkfifo(folder / "sub" / "pipe")
    assert load_corpus(folder, seed=0).num_files == 3


def test_corpus_cap_reads_no_more(tmp_path: Path) -> None:
    """A file past the cap is cut there and never read whole: the peak of the memory that
    loading allocates stays below the file's size (reading it whole would take the file's
    size at once, then copies)."""
    import tracemalloc

    big = tmp_path / "big.txt"
    big.write_bytes(b"abcdefgh\n" * (2 << 20))  # 18 MiB
    cap = 1 << 20
    tracemalloc.start()
    try:
        corpus = load_corpus(big, seed=0, max_bytes=cap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert corpus.train.numel() + corpus.val.numel() == cap
    assert bytes(corpus.train[:9].tolist()) == b"abcdefgh\n"  # its beginning
    assert peak < 8 * cap, peak  # 18 MiB read whole: the old way
