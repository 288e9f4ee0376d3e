"""The model and cases of ranks whose graphs differ (tests/distributed/test_uneven_graphs.py,
experiments/fsdp2_uneven_graphs.py): a vision tower run only where a batch has an image, experts
some rank's tokens skip, a block run twice or again later, a block whose input needs no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from harness import full_state

BATCH, DIM, STEPS = 2, 8, 4


class Plan:
    """What one rank's batch makes its forward run: an image or not, how often the second block
    runs, which rows each expert gets; whether the first block's input needs no gradient
    (``detach``, as behind frozen embeddings without an image) and whether the first block runs
    again after the second (``again``)."""

    def __init__(
        self,
        image: bool,
        repeat: int,
        expert_rows: list[list[int]],
        detach: bool = False,
        again: bool = False,
    ) -> None:
        self.image, self.repeat, self.expert_rows = image, repeat, expert_rows
        self.detach, self.again = detach, again


#: case -> (rank, world, step) -> Plan
CASES: dict[str, Callable[[int, int, int], Plan]] = {
    # an image on rank 0 only, then on the others only, then on every rank, then on none
    "vision": lambda r, w, s: Plan([r == 0, r != 0, True, False][s], 1, [[0, 1], [0, 1]]),
    # expert 1 gets no token on rank (step % world), expert 0 none anywhere in step 3
    "expert": lambda r, w, s: Plan(True, 1, [[] if s == 3 else [0, 1], [] if r == s % w else [1]]),
    # the second block runs twice on rank 0 and once elsewhere
    "repeat": lambda r, w, s: Plan(True, 2 if r == 0 else 1, [[0, 1], [0, 1]]),
    # the first block's input needs no gradient on rank (step % world) only
    "detach": lambda r, w, s: Plan(True, 1, [[0, 1], [0, 1]], detach=r == s % w),
    # every rank runs the first block again after the second in steps 1 and 2; an image on
    # rank 0 only
    "again": lambda r, w, s: Plan(r == 0, 1, [[0, 1], [0, 1]], again=s in (1, 2)),
    "all": lambda r, w, s: Plan(
        (r + s) % 2 == 0, 2 if r == s % w else 1, [[0], [] if r else [1]], r == (s + 1) % w
    ),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Tower(nn.Module):
    """A vision tower: 8x8 images cut into four 4x4 patches, a block over them, pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, DIM, kernel_size=4, stride=4)
        self.block = Block()

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.block(self.patch(image).flatten(2).transpose(1, 2)).mean(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, DIM)
        self.tower = Tower()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, image: torch.Tensor, plan: Plan) -> torch.Tensor:
        h = self.embed(x)
        if plan.image:
            h = h + self.tower(image)
        h = self.blocks[0](h.detach() if plan.detach else h)
        for _ in range(plan.repeat):
            h = self.blocks[1](h)
        if plan.again:
            h = self.blocks[0](h)
        routed = h
        for expert, rows in zip(self.experts, plan.expert_rows, strict=True):
            if rows:  # as mixture-of-experts layers skip an expert no token reached
                index = torch.tensor(rows)
                routed = routed.index_add(0, index, expert(h[index]))
        return self.head(routed).pow(2).mean()


def units(model: Net) -> list[nn.Module]:
    return [model.tower.patch, model.tower.block, *model.blocks, *model.experts]


def data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(world * BATCH, 5, generator=generator),
            torch.randn(world * BATCH, 1, 8, 8, generator=generator),
        )
        for _ in range(STEPS)
    ]


def train(
    model: nn.Module, plans: Callable[[int, int, int], Plan], rank: int, world: int, micro: int = 1
) -> dict:
    """AdamW with weight decay, each rank's forward as ``plans(rank, world, step)`` says (a
    value of ``CASES``); ``rank`` -1: one process on the global batch (the mean of the
    ranks' losses, each on its slice with its plan). ``micro`` micro-batches (the same data
    each) under no_sync. Returns the parameters and, per step, which units' weights have no
    gradient."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    none: list[list[bool]] = []
    for step, (x, image) in enumerate(data(world)):
        for m in range(micro):
            if rank >= 0:
                model.set_requires_gradient_sync(m == micro - 1)
                mine = slice(rank * BATCH, (rank + 1) * BATCH)
                loss = model(x[mine], image[mine], plans(rank, world, step))
            else:
                loss = torch.stack(
                    [
                        model(x[sl], image[sl], plans(r, world, step))
                        for r in range(world)
                        for sl in [slice(r * BATCH, (r + 1) * BATCH)]
                    ]
                ).mean()
            (loss / micro).backward()
        none.append([next(unit.parameters()).grad is None for unit in units(model)[::2]])
        optimizer.step()
        optimizer.zero_grad()
    if rank < 0:
        return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return {"params": full_state(model), "none": none}
