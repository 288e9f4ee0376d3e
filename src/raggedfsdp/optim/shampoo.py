"""Block Shampoo with Adam grafting, on shards that hold whole row-blocks.

Each rank preconditions the blocks it holds with no communication, so the numbers are the
single-device ones; a layout that cuts a block is a ``ValueError``. The update per block, and why
equality is bitwise in practice but promised only to fp32 round-off: the comment at
:class:`Shampoo`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import ShardLayout, row_numel
from ..tensor import global_shape, local_range, shard_info
from ._common import Pieces, ShardedOptimizer, advance_steps, check_betas, check_block_cuts, local

__all__ = ["Shampoo"]

#: A block of a ``[rows, row_len]`` matrix view: ``((row_start, row_end), (col_start, col_end))``.
Block = tuple[tuple[int, int], tuple[int, int]]

#: The per-block state: the statistics and their inverse fourth roots, each kept as one flat
#: fp32 tensor, the concatenation of its blocks' matrices (row-major block order).
_FACTOR_KEYS = ("L", "R", "L_inv_root", "R_inv_root")


def _inverse_fourth_roots(pairs: list[tuple[torch.Tensor, torch.Tensor]], epsilon: float) -> None:
    """``root ← (A + εI)^(-1/4)`` for every ``(A, root)`` pair of symmetric PSD matrices, from
    fp32 eigendecompositions: one batched ``eigh`` per matrix size. ``eigh`` makes the host wait
    for the device (the solver reports its status), so it is paid once per size, not per
    matrix; on the CPU a batch runs the same LAPACK call per matrix, so each root is the one an
    unbatched call gives, whatever else shares its batch.

    fp32 ``eigh`` can return tiny negative eigenvalues for a PSD matrix; they are clamped to 0
    before ``ε`` is added, so the root is always finite.
    """
    by_size: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for matrix, root in pairs:
        by_size.setdefault(matrix.shape[0], []).append((matrix, root))
    for batch in by_size.values():
        eigenvalues, eigenvectors = torch.linalg.eigh(torch.stack([m for m, _ in batch]))
        scales = (eigenvalues.clamp(min=0) + epsilon).pow(-0.25)
        for (_, root), vectors, scale in zip(batch, eigenvectors, scales, strict=True):
            root.copy_((vectors * scale) @ vectors.T)


@dataclass(frozen=True)
class _Item:
    """One parameter in one step: this rank's pieces, its blocks (``None``: not a matrix), its
    step number, its row length, and its factors' per-block matrices (views of the state)."""

    pieces: Pieces
    blocks: list[Block] | None
    step: int
    cols: int
    factors: dict[str, list[torch.Tensor]]


# Each parameter with two or more dimensions is viewed as a matrix ``[rows, row_len]`` (a row as
# docs/design.md defines it: ``[E, out, in]`` is ``[E*out, in]``, a conv filter is one row) and cut
# into blocks of at most ``max_preconditioner_dim`` rows × ``max_preconditioner_dim`` columns. Per
# block ``G``:
#
# - ``L += G Gᵀ`` and ``R += Gᵀ G`` (or an EMA with ``shampoo_beta2 < 1``), in fp32;
# - every ``precondition_frequency`` steps from ``start_preconditioning_step`` (by default every 100
#   steps from step 100), the inverse fourth roots ``L^-1/4``, ``R^-1/4`` are recomputed from fp32
#   eigendecompositions, one batched ``eigh`` per block size for the whole param group (each
#   ``eigh`` is a host sync on an accelerator);
# - the direction ``L^-1/4 · M̂ · R^-1/4`` (``M̂`` the bias-corrected first moment) is rescaled to
#   the Frobenius norm of the Adam direction ``M̂ / (sqrt(V̂) + grafting_epsilon)`` of the same
#   block (Adam grafting: the block's step size is Adam's, its direction Shampoo's);
# - ``p ← p·(1 - lr·weight_decay) - lr · direction`` (decoupled weight decay).
#
# Before the first preconditioner and for 0-D/1-D parameters the direction is Adam's itself.
#
# Sharding: when every rank boundary falls on a multiple of ``max_preconditioner_dim`` rows (the
# planner's unit for ``optimizer_type="shampoo"``), each rank's piece is whole row-blocks, so the
# blocks a rank sees locally are exactly the global blocks it holds: it preconditions them with no
# communication, and the numbers are the single-device ones (same block inputs, same kernels). A
# layout that cuts a block is a ``ValueError``. Equality is bitwise in practice; it is promised only
# to fp32 round-off because BLAS/LAPACK kernels may in principle choose a different summation order
# for the same block (e.g. by thread count or memory alignment) on different processes.
class Shampoo(ShardedOptimizer):
    """Block Shampoo with per-block Adam grafting; single-device and sharded alike.

    Args:
        params: parameters or param groups (sharded pieces or plain tensors).
        lr: learning rate.
        betas: Adam's ``(beta1, beta2)``: ``beta1`` for the first moment that Shampoo
            preconditions, both for the grafted Adam direction (bias-corrected).
        epsilon: added to the eigenvalues of ``L`` and ``R`` before the inverse fourth root.
        weight_decay: decoupled weight decay.
        max_preconditioner_dim: largest block side; a sharded parameter's rank boundaries must
            fall on multiples of this many rows.
        precondition_frequency: steps between recomputations of the inverse roots (default
            100, as every configuration in Distributed Shampoo's README; its signature's 1 is
            "pure" Shampoo, which pays the roots every step).
        start_preconditioning_step: first step (1-based) that uses Shampoo's direction; before
            it, the update is Adam's. ``None`` (default): ``precondition_frequency``, as
            Distributed Shampoo's ``-1``, so the first roots see that many steps of statistics.
        shampoo_beta2: ``1.0`` sums ``G Gᵀ`` and ``Gᵀ G``; below 1, an EMA with this factor.
        grafting_epsilon: Adam's epsilon in the grafted direction.
        skip_nonfinite: skip a step with a NaN/Inf gradient on every rank (else raise).

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (param-shaped) and, for
    matrices, ``L``, ``R``, ``L_inv_root``, ``R_inv_root``: each one flat fp32 tensor, the
    concatenation of its blocks' square matrices in row-major block order (globally every
    block's; of a sharded parameter, placed by :meth:`sharded_state_layout`: this rank holds
    its blocks'). A sharded parameter's state is RaggedTensors ([Note: optimizer state across
    world sizes]).
    """

    _KEEP_DTYPE_STATE_KEYS = _FACTOR_KEYS

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 100,
        start_preconditioning_step: int | None = None,
        *,
        shampoo_beta2: float = 1.0,
        grafting_epsilon: float = 1e-8,
        skip_nonfinite: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "epsilon": epsilon,
            "weight_decay": weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "shampoo_beta2": shampoo_beta2,
            "grafting_epsilon": grafting_epsilon,
        }
        super().__init__(params, defaults, skip_nonfinite=skip_nonfinite)

    def _check_group(self, group: dict[str, Any], group_index: int) -> None:
        super()._check_group(group, group_index)
        where = f"param group {group_index}"
        check_betas(group["betas"], f"{where}: betas")
        if not 0.0 < group["shampoo_beta2"] <= 1.0:
            raise ValueError(
                f"{where}: shampoo_beta2 must be in (0, 1], got {group['shampoo_beta2']}"
            )
        for name in ("epsilon", "grafting_epsilon"):
            if not group[name] > 0:
                raise ValueError(f"{where}: {name} must be > 0, got {group[name]}")
        for name in ("max_preconditioner_dim", "precondition_frequency"):
            if not (isinstance(group[name], int) and group[name] >= 1):
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {group[name]!r}")
        start = group["start_preconditioning_step"]
        if not (start is None or (isinstance(start, int) and start >= 1)):
            raise ValueError(
                f"{where}: start_preconditioning_step must be None or an integer >= 1, "
                f"got {start!r}"
            )
        dim = group["max_preconditioner_dim"]
        for index, p in enumerate(group["params"]):
            info = shard_info(p)
            shape = global_shape(p)
            if info is None or len(shape) < 2:
                continue
            cols = row_numel(shape)
            check_block_cuts(
                self.param_label(group, index, group_index),
                info.layout,
                dim * cols,
                f"Shampoo's blocks of {dim} rows × {min(dim, cols)} columns of its "
                f"[{math.prod(shape) // cols}, {cols}] matrix (max_preconditioner_dim={dim})",
                f"Shard it in whole multiples of {dim} rows, e.g. with "
                f"StructAwarePlanner(optimizer_type='shampoo', max_preconditioner_dim={dim}).",
            )

    def sharded_state_layout(self, param: torch.Tensor, key: str) -> ShardLayout | None:
        """The base rules, and for the factors (``L``, ``R`` and their inverse roots) of a
        sharded matrix the layout of the concatenation of every global block's flattened factor
        (row-major block order), in which this rank holds those of its own blocks (so a
        checkpoint reshards them with their blocks)."""
        layout = super().sharded_state_layout(param, key)
        if layout is None or key not in _FACTOR_KEYS:
            return layout
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        dim = group["max_preconditioner_dim"]
        shape = layout.global_shape
        cols = row_numel(shape)
        rows = math.prod(shape) // cols
        # Elements of one row-block's factors, over its column blocks.
        per_row_block = [
            sum(
                _factor_numel(key, (r, min(r + dim, rows)), (c, min(c + dim, cols)))
                for c in range(0, cols, dim)
            )
            for r in range(0, rows, dim)
        ]
        prefix = [0]
        for size in per_row_block:
            prefix.append(prefix[-1] + size)
        ranges = tuple(
            (prefix[-(-(start // cols) // dim)], prefix[-(-(end // cols) // dim)])
            for start, end in layout.ranges
        )
        return ShardLayout(torch.Size((prefix[-1],)), 1, ranges)

    def _update(self) -> None:
        """Per param group: every parameter's moments and statistics, then the inverse roots
        due this step, batched per block size, then every parameter's update."""
        for group in self.param_groups:
            items = self._items(group)
            due = [pair for item in items for pair in _statistics(item, group)]
            _inverse_fourth_roots(due, group["epsilon"])
            for item in items:
                _apply(item, group)

    def _items(self, group: dict[str, Any]) -> list[_Item]:
        """The parameters of ``group`` with a gradient, as this step sees them (the steps
        advanced and read in one host read)."""
        params = [p for p in group["params"] if p.grad is not None]
        dim = group["max_preconditioner_dim"]
        blocks = [_local_blocks(p, dim) if len(global_shape(p)) >= 2 else None for p in params]
        pieces = [
            self._pieces(p, functools.partial(self._new_state, blocks=b))
            for p, b in zip(params, blocks, strict=True)
        ]
        steps = advance_steps([x.state["step"] for x in pieces])
        return [
            _Item(x, b, int(step), row_numel(global_shape(p)), _factors(x.state, b))
            for p, x, b, step in zip(params, pieces, blocks, steps, strict=True)
        ]

    def _new_state(self, p: torch.Tensor, blocks: list[Block] | None) -> dict[str, Any]:
        """The state of a new parameter: zero moments and, for a matrix, zero factors (the
        roots are filled before their first use)."""
        zeros = torch.zeros_like(local(p), memory_format=torch.preserve_format)
        state: dict[str, Any] = {
            "step": torch.tensor(0.0),
            "exp_avg": self._placed(p, "exp_avg", zeros),
            "exp_avg_sq": self._placed(p, "exp_avg_sq", zeros.clone()),
        }
        for key in _FACTOR_KEYS if blocks is not None else ():
            numel = sum(_factor_numel(key, *block) for block in blocks)  # type: ignore[union-attr]
            flat = torch.zeros(numel, dtype=torch.float32, device=zeros.device)
            state[key] = self._placed(p, key, flat)
        return state


def _start(group: dict[str, Any]) -> int:
    """The first step that uses Shampoo's direction."""
    start = group["start_preconditioning_step"]
    return group["precondition_frequency"] if start is None else start


def _statistics(item: _Item, group: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The moments and, for a matrix, ``L`` and ``R`` of one parameter, updated; returns the
    ``(factor, root)`` pairs whose roots are due this step."""
    _, grad, state = item.pieces
    beta1, beta2 = group["betas"]
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    if item.blocks is None:
        return []
    # The statistics gather from step 1, so the first preconditioner already has history.
    _accumulate(item.factors, item.blocks, grad.reshape(-1, item.cols), group["shampoo_beta2"])
    start = _start(group)
    if item.step < start or (item.step - start) % group["precondition_frequency"]:
        return []
    factors = item.factors
    return [
        pair
        for key in ("L", "R")
        for pair in zip(factors[key], factors[f"{key}_inv_root"], strict=True)
    ]


def _apply(item: _Item, group: dict[str, Any]) -> None:
    """Weight decay and the step of one parameter: Adam's direction, or, for a matrix from
    ``start_preconditioning_step``, Shampoo's grafted to Adam's length block by block."""
    param, _, state = item.pieces
    beta1, beta2 = group["betas"]
    first = state["exp_avg"] / (1 - beta1**item.step)
    denom = (state["exp_avg_sq"] / (1 - beta2**item.step)).sqrt().add_(group["grafting_epsilon"])
    adam = first / denom
    param.mul_(1 - group["lr"] * group["weight_decay"])
    if item.blocks is None or item.step < _start(group):
        param.add_(adam, alpha=-group["lr"])
        return
    first2d, adam2d = first.view(-1, item.cols), adam.view(-1, item.cols)
    direction = torch.empty_like(adam2d)
    for (rows, cols), left, right in zip(
        item.blocks, item.factors["L_inv_root"], item.factors["R_inv_root"], strict=True
    ):
        block = (slice(*rows), slice(*cols))
        shampoo = left @ first2d[block].float() @ right
        shampoo_norm = torch.linalg.vector_norm(shampoo)
        adam_norm = torch.linalg.vector_norm(adam2d[block].float())
        # Grafting: Adam's step length, Shampoo's direction (0 where Shampoo's is 0).
        scale = torch.where(shampoo_norm > 0, adam_norm / shampoo_norm, 0.0)
        direction[block] = shampoo * scale
    param.add_(direction.view(param.shape), alpha=-group["lr"])


def _factor_numel(key: str, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """Elements of factor ``key`` of one block: ``L`` is rows × rows, ``R`` cols × cols."""
    span = rows if key.startswith("L") else cols
    return (span[1] - span[0]) ** 2


def _factors(state: dict[str, Any], blocks: list[Block] | None) -> dict[str, list[torch.Tensor]]:
    """Every factor's per-block matrices (views of the state's flat pieces); none for a
    parameter that is not a matrix."""
    if blocks is None:
        return {}
    return {key: _blocks_of(state[key], key, blocks) for key in _FACTOR_KEYS}


def _blocks_of(flat: torch.Tensor, key: str, blocks: list[Block]) -> list[torch.Tensor]:
    """The square matrix of factor ``key`` of every block, as views of the state's flat
    concatenation (row-major block order)."""
    out, position = [], 0
    for rows, cols in blocks:
        numel = _factor_numel(key, rows, cols)
        side = math.isqrt(numel)
        out.append(flat[position : position + numel].view(side, side))
        position += numel
    return out


def _accumulate(
    factors: dict[str, list[torch.Tensor]], blocks: list[Block], grad2d: torch.Tensor, beta: float
) -> None:
    """``L += G Gᵀ``, ``R += Gᵀ G`` per block (an EMA when ``beta < 1``)."""
    for (rows, cols), left, right in zip(blocks, factors["L"], factors["R"], strict=True):
        g = grad2d[slice(*rows), slice(*cols)].float()
        if beta == 1.0:
            left.addmm_(g, g.T)
            right.addmm_(g.T, g)
        else:
            left.mul_(beta).addmm_(g, g.T, alpha=1 - beta)
            right.mul_(beta).addmm_(g.T, g, alpha=1 - beta)


def _local_blocks(p: torch.Tensor, dim: int) -> list[Block]:
    """This rank's blocks as ``((row_start, row_end), (col_start, col_end))`` in its local
    ``[rows, row_len]`` view, row-major; they are the global blocks of the rows it holds."""
    shape = global_shape(p)
    cols = row_numel(shape)
    start, end = local_range(p)
    first_row, last_row = start // cols, end // cols
    total_rows = math.prod(shape) // cols
    blocks = []
    for row in range(first_row, last_row, dim):
        rows = (row - first_row, min(row + dim, total_rows) - first_row)
        blocks += [(rows, (col, min(col + dim, cols))) for col in range(0, cols, dim)]
    return blocks
