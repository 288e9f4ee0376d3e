"""Block Shampoo with Adam grafting, on shards that hold whole row-blocks.

Each parameter with two or more dimensions is viewed as a matrix ``[rows, row_len]`` (a row as
DESIGN.md defines it: ``[E, out, in]`` is ``[E*out, in]``, a convolution filter is one row) and cut
into blocks of at most ``max_preconditioner_dim`` rows × ``max_preconditioner_dim`` columns. Per
block ``G``:

- ``L += G Gᵀ`` and ``R += Gᵀ G`` (or an EMA with ``shampoo_beta2 < 1``), in fp32;
- every ``precondition_frequency`` steps from ``start_preconditioning_step``, the inverse fourth
  roots ``L^-1/4``, ``R^-1/4`` are recomputed from an fp32 ``eigh``;
- the direction ``L^-1/4 · M̂ · R^-1/4`` (``M̂`` the bias-corrected first moment) is rescaled to
  the Frobenius norm of the Adam direction ``M̂ / (sqrt(V̂) + grafting_epsilon)`` of the same
  block (Adam grafting: the block's step size is Adam's, its direction Shampoo's);
- ``p ← p·(1 - lr·weight_decay) - lr · direction`` (decoupled weight decay).

Before the first preconditioner and for 0-D/1-D parameters the direction is Adam's itself.

Sharding: when every rank boundary falls on a multiple of ``max_preconditioner_dim`` rows (the
planner's unit for ``optimizer_type="shampoo"``), each rank's piece is whole row-blocks, so the
blocks a rank sees locally are exactly the global blocks it holds: it preconditions them with no
communication, and the numbers are the single-device ones (same block inputs, same kernels). A
layout that cuts a block is a ``ValueError``. Equality is bitwise in practice; it is promised only
to fp32 round-off because BLAS/LAPACK kernels may in principle choose a different summation order
for the same block (e.g. by thread count or memory alignment) on different processes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layout import ShardLayout, row_numel, shard_info
from ._common import (
    ShardedOptimizer,
    check_betas,
    check_block_cuts,
    global_shape,
    local,
    local_range,
)

__all__ = ["Shampoo"]

#: A block of a ``[rows, row_len]`` matrix view: ``((row_start, row_end), (col_start, col_end))``.
Block = tuple[tuple[int, int], tuple[int, int]]

#: The per-block state: the statistics and their inverse fourth roots, each kept as one flat
#: fp32 tensor, the concatenation of its blocks' matrices (row-major block order).
_FACTOR_KEYS = ("L", "R", "L_inv_root", "R_inv_root")


def _inverse_fourth_root(matrix: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``(A + εI)^(-1/4)`` of a symmetric PSD matrix, from an fp32 eigendecomposition.

    fp32 ``eigh`` can return tiny negative eigenvalues for a PSD matrix; they are clamped to 0
    before ``ε`` is added, so the root is always finite.
    """
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    scale = (eigenvalues.clamp(min=0) + epsilon).pow(-0.25)
    return (eigenvectors * scale) @ eigenvectors.T


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
        precondition_frequency: steps between recomputations of the inverse roots.
        start_preconditioning_step: first step (1-based) that uses Shampoo's direction; before
            it, the update is Adam's.
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
        precondition_frequency: int = 1,
        start_preconditioning_step: int = 1,
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
        if not (isinstance(start, int) and start >= 1):
            raise ValueError(
                f"{where}: start_preconditioning_step must be an integer >= 1, got {start!r}"
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
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update_param(p, group)

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

    def _update_param(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        shape = global_shape(p)
        blocks = _local_blocks(p, group["max_preconditioner_dim"]) if len(shape) >= 2 else None
        param, grad, state = self._pieces(p, lambda p: self._new_state(p, blocks))
        state["step"] += 1
        step = int(state["step"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        first = exp_avg / (1 - beta1**step)
        adam = first / (exp_avg_sq / (1 - beta2**step)).sqrt().add_(group["grafting_epsilon"])
        param.mul_(1 - group["lr"] * group["weight_decay"])
        start = group["start_preconditioning_step"]
        if blocks is None:
            param.add_(adam, alpha=-group["lr"])
            return
        cols = row_numel(shape)
        factors = {key: _blocks_of(state[key], key, blocks) for key in _FACTOR_KEYS}
        # The statistics gather from step 1, so the first preconditioner already has history.
        _accumulate(factors, blocks, grad.reshape(-1, cols), group["shampoo_beta2"])
        if step < start:
            param.add_(adam, alpha=-group["lr"])
            return
        if (step - start) % group["precondition_frequency"] == 0:
            for key in ("L", "R"):
                for m, root in zip(factors[key], factors[f"{key}_inv_root"], strict=True):
                    root.copy_(_inverse_fourth_root(m, group["epsilon"]))
        first2d, adam2d = first.view(-1, cols), adam.view(-1, cols)
        direction = torch.empty_like(adam2d)
        for (rows, cols_), left, right in zip(
            blocks, factors["L_inv_root"], factors["R_inv_root"], strict=True
        ):
            block = (slice(*rows), slice(*cols_))
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
