"""``raggedfsdp export``: a training checkpoint's model as a plain state dict.

Of the unwrapped model; :func:`raggedfsdp.train.checkpoints.export_checkpoint` does the work.
"""

from __future__ import annotations

import argparse

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``export`` arguments to ``parser``: the checkpoint and where to write it."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint folder (checkpoints/step_NNNNNN) or a run's --out (its newest one)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="where to write the state dict: FILE.safetensors in that format, any other name "
        "with torch.save (and FILE.safetensors beside it when the safetensors package is "
        "installed)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace files that exist at --out"
    )


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint's model as a plain state dict, and say where it went."""
    from ..train.checkpoints import export_checkpoint  # DCP loads only for an export

    for path in export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite):
        print(f"wrote {path}")
    return 0
