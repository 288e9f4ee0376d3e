"""Train a GPT with raggedfsdp: the job one worker runs.

Launch it with ``raggedfsdp train`` (which starts the workers through torchrun's own code path),
or with torchrun directly::

    torchrun --standalone --nproc-per-node 2 -m raggedfsdp.train --model gpt-tiny --steps 50

Every option is a :class:`~raggedfsdp.train_config.TrainConfig` field (``--help`` lists them).
The script below reads top to bottom: distributed set-up, output folder and resume point, data,
model, optimizer, resume, monitoring, the training loop, the end. Helpers live in
``train_config`` (options), ``train_checkpoint`` (checkpoints), ``monitor`` (metrics and reports)
and ``health`` (timeouts, watchdog, NaN handling).

Reproducibility: every rank builds the same model from ``--seed``, and the global batch of step
``k`` depends only on ``(seed, k)``, so a run resumed from a checkpoint - at the same or another
world size - sees the same batches as an uninterrupted one (at the same world size the result is
bit for bit the same).

Errors: a user error (bad option, missing data, incompatible checkpoint, ...) is a ``ValueError``;
every rank meets it alike, so rank 0 reports it, in one line, and exits with status 2 (``--debug``
shows the traceback); another rank reports only an error rank 0 did not have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .._console import USAGE_ERROR
from .._host import local_device, synchronize
from ..clip import clip_grad_norm_
from ..data import BatchSampler, eval_batches, load_corpus
from ..layout import global_shape
from . import health
from .build import build_model, build_optimizer, lr_factor, optimizer_bytes
from .checkpoints import load_checkpoint, save_checkpoint
from .config import TrainConfig, add_config_arguments, config_from_args
from .monitor import Monitor, StepTimes
from .preflight import dry_run_report
from .run_dir import latest_checkpoint, prepare_out_dir, remove_partial

__all__ = ["build_parser", "evaluate", "main", "train"]

#: Seconds a rank other than 0 waits before reporting a user error (see main()).
ERROR_GRACE_S = 3.0

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Distributed helpers.


def _rank0_decides(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and give every rank its result, or its ``ValueError``: decisions
    about shared files (which checkpoint, may the folder be used) must agree across ranks."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except ValueError as err:
            box[0] = ("error", str(err))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ValueError(value)
    return value


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device) -> float:
    """Mean validation loss over the fixed batches and all ranks."""
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in batches:
        total += model(x.to(device), y.to(device)).float()
    model.train()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


# ---------------------------------------------------------------------------------------------
# The job.


def build_parser() -> argparse.ArgumentParser:
    """The worker's options: every TrainConfig field, ``--config`` and ``--debug``."""
    parser = argparse.ArgumentParser(
        prog="raggedfsdp.train", description="Train a GPT with raggedfsdp (one worker)."
    )
    add_config_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def train(cfg: TrainConfig) -> None:
    """Run the job described by ``cfg`` on the process group that torchrun set up (or on one
    process without torchrun)."""
    started = time.perf_counter()

    # -- distributed -----------------------------------------------------------------------------
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg.check_world(world)
    if cfg.dry_run:
        if rank == 0:
            print(dry_run_report(cfg, world))
        return
    device = local_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    health.init_process_group(backend, timeout_s=cfg.comm_timeout_s, device=device)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    # -- output folder and resume point ----------------------------------------------------------
    out = Path(cfg.out)
    resume = cfg.resume or restarted  # an elastic restart continues from the last checkpoint

    def open_out_dir() -> str | None:
        prepare_out_dir(out, resume=resume, overwrite=cfg.overwrite and not restarted)
        if not resume:
            return None
        for path in remove_partial(out):
            print(f"removed an incomplete checkpoint: {path}", flush=True)
        ckpt = latest_checkpoint(out)
        return None if ckpt is None else str(ckpt)

    ckpt = _rank0_decides(open_out_dir)
    if rank == 0 and resume and ckpt is None:
        print(f"no complete checkpoint in {out}: starting from step 0", flush=True)
    if rank == 0:
        (out / "config.json").write_text(
            json.dumps({**cfg.to_dict(), "world_size": world}, indent=2) + "\n"
        )

    # -- data ------------------------------------------------------------------------------------
    corpus = load_corpus(cfg.data, seed=cfg.seed)
    seq_len = cfg.tokens_per_seq
    sampler = BatchSampler(
        corpus.train,
        seq_len=seq_len,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
    )
    val_batches = eval_batches(
        corpus.val,
        cfg.eval_batches,
        seq_len=seq_len,
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
    )

    # -- model -----------------------------------------------------------------------------------
    model = build_model(cfg, device)
    stats = model.stats()
    padding_ratio = stats["padding_numel"] / max(1, stats["param_numel"])

    # -- optimizer -------------------------------------------------------------------------------
    optimizer = build_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]

    # -- resume ----------------------------------------------------------------------------------
    start_step = 0
    if ckpt is not None:
        meta = load_checkpoint(ckpt, model=model, optimizer=optimizer)
        sampler.load_state_dict(meta["data"])
        start_step = meta["step"]
        saved = meta["config"]
        changed = [k for k in ("seed", "batch_size", "seq_len") if saved.get(k) != getattr(cfg, k)]
        if rank == 0:
            print(
                f"resumed from {ckpt} (step {start_step}, saved on {meta['world_size']} "
                f"rank(s), now {world})"
                + (f"; changed {', '.join(changed)}: the data order differs" if changed else ""),
                flush=True,
            )

    # -- monitoring and health -------------------------------------------------------------------
    monitor = Monitor(
        cfg,
        rank=rank,
        world_size=world,
        start_step=start_step,
        padding_ratio=padding_ratio,
        device=device,
    )
    monitor.print(
        f"{cfg.model}: {sum(global_shape(p).numel() for p in params):,} parameters, "
        f"{world} rank(s) "
        f"({backend}), optimizer {cfg.optimizer}, block {cfg.block_size}, padding "
        f"{100 * padding_ratio:.3f}%, corpus {corpus.source} "
        f"({corpus.train.numel():,} train tokens)"
    )
    watchdog = health.StepWatchdog(cfg.step_timeout_s, rank=rank)
    faults = out / ".faults"
    crash_rank = 1 if world > 1 else 0

    def save(step: int) -> None:
        def before_commit() -> None:
            if cfg.fail_during_save == step and rank == world - 1:
                health.crash_once(faults / f"save_{step}")

        path = save_checkpoint(
            out,
            step,
            model=model,
            optimizer=optimizer,
            meta={"config": cfg.to_dict(), "data": sampler.state_dict()},
            before_commit=before_commit,
        )
        monitor.print(f"checkpoint: {path}")

    # -- training loop ---------------------------------------------------------------------------
    if start_step == 0:
        monitor.eval(0, evaluate(model, val_batches, device))  # where the loss starts
    for step in range(start_step, cfg.steps):
        done = step + 1  # steps completed after this one
        if cfg.fail_at_step == done and rank == crash_rank:
            health.crash_once(faults / f"step_{done}")
        with watchdog.step(done):
            t0 = time.perf_counter()
            model.reset_stats()
            factor = lr_factor(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
            x, y = sampler.next()
            loss_sum = torch.zeros((), device=device)
            micro = list(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum), strict=True))
            for i, (xb, yb) in enumerate(micro):
                # Reduce gradients only after the last micro-batch; the others accumulate.
                with nullcontext() if i == len(micro) - 1 else model.no_sync():
                    loss = model(xb.to(device), yb.to(device)) / len(micro)
                    loss.backward()
                loss_sum += loss.detach()
            synchronize(device)
            t_backward = time.perf_counter()
            loss_value = health.global_loss(loss_sum)
            t_optimizer = time.perf_counter()
            grad_norm = clip_grad_norm_(params, cfg.grad_clip).item() if cfg.grad_clip else None
            finite = math.isfinite(loss_value) and (grad_norm is None or math.isfinite(grad_norm))
            if finite:
                optimizer.step()
            elif cfg.on_nan == "stop":
                raise health.NonFiniteLossError(
                    f"step {done}: the loss is {loss_value} (gradient norm {grad_norm}) on some "
                    f"rank; stopping (--on-nan skip would skip such steps)"
                )
            else:
                monitor.print(f"step {done}: non-finite loss or gradient; step skipped")
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            t_end = time.perf_counter()
        stats = model.stats()
        comm = stats["comm_wait_seconds"]
        monitor.step(
            done,
            loss=loss_value,
            lr=optimizer.param_groups[0]["lr"],
            grad_norm=grad_norm,
            times=StepTimes(
                total=t_end - t0,
                compute=max(0.0, t_backward - t0 - comm),
                comm=comm,
                optimizer=t_end - t_optimizer,
            ),
            stats=stats,
            optimizer_bytes=optimizer_bytes(optimizer),
            skipped=not finite,
        )
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            monitor.eval(done, evaluate(model, val_batches, device))
        if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
            save(done)

    # -- the end ---------------------------------------------------------------------------------
    watchdog.close()
    monitor.close(wall_s=time.perf_counter() - started)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and train; the exit status (user errors: one line, status 2)."""
    args = build_parser().parse_args(argv)
    # raggedfsdp's DCP values are ShardedTensors (the only DCP container for ragged shards; see
    # checkpoint.py), which torch warns about on every save and load.
    warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
    try:
        train(config_from_args(args))
    except (ValueError, health.NonFiniteLossError) as err:
        if args.debug:
            raise
        message = " ".join(str(err).split())
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:
            # Ranks meet user errors alike: rank 0 reports it, and its exit makes torchrun stop
            # this worker during the wait. A rank still alive after the wait met an error of
            # its own, and reports it.
            time.sleep(ERROR_GRACE_S)
            message = f"rank {rank}: {message}"
        sys.stderr.write(f"raggedfsdp: error: {message}\n")
        return USAGE_ERROR if isinstance(err, ValueError) else 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: Gloo sometimes aborts there after all work is done, and a
    # non-zero exit would make torchrun's agent restart a finished job.
    os._exit(code)
