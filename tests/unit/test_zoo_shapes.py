"""Every zoo model's parameters and buffers, names and shapes in model order, against a record.

The record (``tests/support/zoo_shapes.json``) holds, per name in ``MODEL_NAMES``, how many
parameters the model has, their total elements, and a SHA-256 of the ordered ``name shape``
lines; the same for buffers. A refactor of the zoo must leave every model's lists identical. A
change meant to alter a model rewrites the record with ``PYTHONPATH=src python
tests/unit/test_zoo_shapes.py`` and shows the changed rows in its diff. Built on the meta device,
so the 671B models cost seconds, not memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from raggedfsdp.models import MODEL_NAMES, build_model

RECORD = Path(__file__).parents[1] / "support" / "zoo_shapes.json"


def _summary(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, object]:
    named = list(named)
    lines = [f"{name} {tuple(t.shape)}" for name, t in named]
    numel = sum(t.numel() for _, t in named)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return {"count": len(lines), "numel": numel, "sha256": digest}


def record(name: str) -> dict[str, object]:
    """The record of one model, built on the meta device."""
    model = build_model(name)
    return {
        "parameters": _summary(model.named_parameters()),
        "buffers": _summary(model.named_buffers()),
    }


def test_record_covers_every_model() -> None:
    assert sorted(json.loads(RECORD.read_text())) == sorted(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_zoo_model_matches_record(name: str) -> None:
    assert record(name) == json.loads(RECORD.read_text())[name]


if __name__ == "__main__":
    RECORD.write_text(json.dumps({n: record(n) for n in MODEL_NAMES}, indent=1) + "\n")
