"""Image-text samples for a vision-language model: scikit-learn's handwritten digits, no download.

``load_digits`` gives 1,797 8x8 images (split into training and held-out digits); a sample is one
digit upscaled for the tower and the text ``<image> this is the digit 7``. :class:`ImageTextSampler`
mixes such samples with text windows of the byte-level corpus (:mod:`raggedfsdp.data`), a batch a
function of ``(seed, step)`` only, as :class:`~raggedfsdp.data.BatchSampler`'s.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .data import BatchSampler, generator_seed, sample_batch

__all__ = [
    "IGNORE_INDEX",
    "INSTALL_HINT",
    "PROMPT",
    "Digits",
    "ImageFormat",
    "ImageTextSampler",
    "check_installed",
    "digit_rows",
    "load_digits",
    "to_pixels",
]

IGNORE_INDEX = -100
"""The target of a position the loss skips (an image token, the padding after a sample): the
default ``ignore_index`` of torch's cross-entropy."""

PROMPT = b" this is the digit "
"""The text after the image; the next token is the digit's byte (``b"7"``)."""

INSTALL_HINT = (
    "the image-text data of a vision-language --hf-config (scikit-learn's digits) needs "
    "scikit-learn: pip install 'raggedfsdp[vlm]'"
)

#: One digit in this many is held out (never trained on): 299 of the 1,797.
_HELD_OUT_EVERY = 6
#: XOR-ed into a batch's generator seed for its image draws, so that they are a stream apart
#: from the text windows' (low 32 bits: torch's generator keeps only those).
_IMAGE_SALT = 0x5BD1_E995


@dataclass(frozen=True)
class ImageFormat:
    """How a model takes one image (:func:`raggedfsdp.models.hf.image_format` makes it)."""

    prefix: tuple[int, ...]
    """The token ids standing for the image, before the text: the model puts the tower's
    features where its image tokens are."""
    size: int
    """Side of the square image in pixels."""
    channels: int
    """Colour channels the tower takes (the grey digit is repeated over them)."""

    @property
    def sample_len(self) -> int:
        """Tokens of one image-text sample: the image, the prompt and the digit."""
        return len(self.prefix) + len(PROMPT) + 1

    def check_fits(self, seq_len: int) -> None:
        """``ValueError`` unless a sample fits in ``seq_len`` tokens."""
        if seq_len < self.sample_len:
            raise ValueError(
                f"seq_len: {seq_len} tokens cannot hold an image-text sample of {self.sample_len} "
                f"({len(self.prefix)} image tokens, the prompt and the digit)"
            )

    @property
    def answer_position(self) -> int:
        """Index of the prompt's last token in a sample: its next token is the digit."""
        return self.sample_len - 2


@dataclass(frozen=True)
class Digits:
    """Handwritten digits: ``images`` float32 ``[n, 8, 8]`` in ``[0, 1]``, ``labels`` int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.numel())


def check_installed() -> None:
    """``ValueError`` (:data:`INSTALL_HINT`) without scikit-learn, before any worker starts
    (nothing is imported: the launcher pays nothing for it)."""
    if importlib.util.find_spec("sklearn") is None:
        raise ValueError(INSTALL_HINT)


def load_digits() -> tuple[Digits, Digits]:
    """scikit-learn's 1,797 digits, split into training digits and held-out ones (every sixth,
    so both hold every class in about equal measure). ``ValueError`` (:data:`INSTALL_HINT`)
    without scikit-learn."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    data = sklearn_digits()
    images = torch.as_tensor(data.images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    labels = torch.as_tensor(data.target, dtype=torch.int64)
    held = torch.arange(len(labels)) % _HELD_OUT_EVERY == _HELD_OUT_EVERY - 1
    return Digits(images[~held], labels[~held]), Digits(images[held], labels[held])


def to_pixels(images: torch.Tensor, fmt: ImageFormat) -> torch.Tensor:
    """``images`` (``[n, 8, 8]`` in ``[0, 1]``) as the tower takes them: ``[n, C, S, S]``,
    upscaled bilinearly to ``fmt.size``, in ``[-1, 1]`` (as CLIP's and Qwen's processors
    normalise, give or take their per-channel statistics), grey on every channel."""
    upscaled = F.interpolate(images[:, None], size=(fmt.size, fmt.size), mode="bilinear")
    return (upscaled * 2.0 - 1.0).expand(-1, fmt.channels, -1, -1).contiguous()


def digit_rows(
    digits: Digits, index: torch.Tensor, fmt: ImageFormat, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples of ``digits[index]`` as rows ``(x, y, pixels)`` of ``seq_len`` tokens: ``x``
    the image tokens, the prompt and the digit, padded with zeros; ``y`` the next tokens, -100
    (:data:`IGNORE_INDEX`) where the next token is an image token or padding."""
    fmt.check_fits(seq_len)
    n = int(index.numel())
    text = torch.tensor(list(PROMPT), dtype=torch.int64)
    sample = torch.cat(
        [
            torch.tensor(fmt.prefix, dtype=torch.int64).expand(n, -1),
            text.expand(n, -1),
            (digits.labels[index] + ord("0"))[:, None],
        ],
        dim=1,
    )
    x = torch.zeros(n, seq_len, dtype=torch.int64)
    y = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    x[:, : fmt.sample_len - 1] = sample[:, :-1]
    y[:, : fmt.sample_len - 1] = sample[:, 1:]
    y[:, : len(fmt.prefix) - 1] = IGNORE_INDEX  # the image's own tokens are given, not predicted
    return x, y, to_pixels(digits.images[index], fmt)


class ImageTextSampler(BatchSampler):
    """Batches of image-text samples mixed with text windows, sliced for one data-parallel rank.

    Row ``i`` of the global batch of step ``k`` is a digit's sample with probability
    ``image_fraction``, a text window of ``tokens`` otherwise; which, and which digit, depend on
    ``(seed, k)`` only (as :func:`~raggedfsdp.data.sample_batch`'s windows), so the ranks'
    slices concatenate to the same global batch at every world size and a resumed run sees the
    same batches. In some steps some ranks then have no image: their vision tower does not run
    (raggedfsdp trains ranks whose graphs differ as one process).

    A batch is ``(x, y, pixels)``: int64 ``[b, seq_len]`` twice and float ``[b, C, S, S]``
    (zeros in a text row), ``b = global_batch // world_size``.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        digits: Digits,
        fmt: ImageFormat,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        rank: int,
        world_size: int,
        image_fraction: float,
    ) -> None:
        if not 0.0 <= image_fraction <= 1.0:
            raise ValueError(f"image_fraction must be in [0, 1], got {image_fraction!r}")
        fmt.check_fits(seq_len)
        super().__init__(
            tokens,
            seq_len=seq_len,
            global_batch=global_batch,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        self.digits, self.fmt = digits, fmt
        self.image_fraction = image_fraction

    def batch(
        self, step: int, *, split: str = "train", digits: Digits | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows of batch ``step`` of ``split`` (its text windows from ``tokens``,
        its digits from ``digits``, default the sampler's own)."""
        digits = self.digits if digits is None else digits
        x, y = sample_batch(
            self.tokens,
            step,
            seq_len=self.seq_len,
            batch_size=self.global_batch,
            seed=self.seed,
            split=split,
        )
        gen = torch.Generator().manual_seed(
            generator_seed(self.seed, step, split=split) ^ _IMAGE_SALT
        )
        draws = torch.rand(self.global_batch, generator=gen)
        which = torch.randint(len(digits), (self.global_batch,), generator=gen)
        images = draws < self.image_fraction
        lo, hi = self.rank * self.local_batch, (self.rank + 1) * self.local_batch
        # Copies: x and y are overlapping views of the same windows.
        x, y, images, which = x[lo:hi].clone(), y[lo:hi].clone(), images[lo:hi], which[lo:hi]
        pixels = torch.zeros(self.local_batch, self.fmt.channels, self.fmt.size, self.fmt.size)
        rows = images.nonzero().flatten()
        x[rows], y[rows], pixels[rows] = digit_rows(digits, which[rows], self.fmt, self.seq_len)
        return x, y, pixels

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """This rank's batch of the current step, then advance the step."""
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def mixed_eval_batches(
        self, val_tokens: torch.Tensor, held_out: Digits, num_batches: int
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Fixed validation batches: the ``"eval"`` stream's steps ``0..num_batches-1`` over
        the validation text and the held-out digits (never a training sample)."""
        held = ImageTextSampler(
            val_tokens,
            held_out,
            self.fmt,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            image_fraction=self.image_fraction,
        )
        return [held.batch(i, split="eval") for i in range(num_batches)]

    def accuracy_batches(
        self, held_out: Digits
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every held-out digit once, as this rank's ``(x, pixels, labels, counted)`` batches:
        digit ``i`` on rank ``i % world_size``; every rank gets as many batches of at most
        ``local_batch`` rows as the others (each a collective), a rank's last rows repeating a
        digit where it ran out, not ``counted``."""
        per_rank = math.ceil(len(held_out) / self.world_size)
        index = torch.arange(self.rank, per_rank * self.world_size, self.world_size)
        counted = index < len(held_out)
        index = torch.where(counted, index, 0)
        batches = []
        for start in range(0, per_rank, self.local_batch):
            part = index[start : start + self.local_batch]
            x, _, pixels = digit_rows(held_out, part, self.fmt, self.seq_len)
            labels = held_out.labels[part]
            batches.append((x, pixels, labels, counted[start : start + self.local_batch]))
        return batches
