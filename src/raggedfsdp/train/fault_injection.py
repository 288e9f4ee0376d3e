"""A failure staged once to rehearse recovery: ``--inject-fault KIND=STEP`` (docs/operations.md)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Fault", "FaultKind"]


class FaultKind(Enum):
    """What ``--inject-fault`` kills."""

    KILL_AT_STEP = "kill-at-step"
    """A worker, at the start of a step: a crash the agent's restart must recover from."""

    KILL_DURING_SAVE = "kill-during-save"
    """The last rank, after it wrote its files of a checkpoint and before the checkpoint is
    complete: what resuming must survive."""


@dataclass(frozen=True)
class Fault:
    """A failure staged once to rehearse recovery (``--inject-fault KIND=STEP``)."""

    kind: FaultKind
    step: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``kill-at-step=5`` -> ``Fault(FaultKind.KILL_AT_STEP, 5)``; ``ValueError`` naming
        the option otherwise."""
        kind, _, step = text.partition("=")
        kinds = [k.value for k in FaultKind]
        if kind not in kinds or not step.isdigit() or int(step) < 1:
            raise ValueError(
                f"inject_fault: expected KIND=STEP with KIND one of {', '.join(kinds)} and "
                f"STEP >= 1, got {text!r}"
            )
        return cls(FaultKind(kind), int(step))
