"""What a training run reports: progress, log lines, ``metrics.jsonl``, TensorBoard, a summary.

Every rank calls :meth:`Monitor.step` after every step (it holds a collective at log steps: the peak
memory is the maximum over ranks); only rank 0 prints and writes. A record of ``metrics.jsonl``
averages the steps since the previous record (its fields: the comment at :class:`Monitor`); on
resume, records after the resumed step are dropped, so the file (and the report) describe one
trajectory.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from .._console import format_bytes, write_whole
from .config import TrainConfig

__all__ = ["METRICS", "REPORT", "Monitor", "StepTimes", "read_metrics", "window_peaks"]

METRICS = "metrics.jsonl"
REPORT = "report.png"
_MIB = 1024 * 1024
#: The per-step byte counters whose sum is what a rank puts on the wire.
_WIRE = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")


@dataclass(frozen=True)
class StepTimes:
    """Wall-clock seconds of one step and its parts (``total = compute + comm + optimizer +
    the rest``: loss all-reduce, data, logging)."""

    total: float
    compute: float
    comm: float
    optimizer: float


#: How ``metrics.jsonl`` spells the floats JSON has no literal for (strict JSON, RFC 8259).
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _to_json(record: Mapping[str, Any]) -> str:
    """One strict-JSON line: a non-finite float is written as the string ``"nan"``, ``"inf"``
    or ``"-inf"`` (Python's json would write bare ``NaN``, which other readers reject)."""

    def strict(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return value

    return json.dumps({key: strict(value) for key, value in record.items()}, allow_nan=False)


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """The records of ``OUT/metrics.jsonl`` (a torn last line, from a crash, is skipped), with
    the strings ``"nan"``, ``"inf"`` and ``"-inf"`` read back as floats."""
    path = Path(out) / METRICS
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records.append(
            {
                key: _NON_FINITE.get(value, value) if isinstance(value, str) else value
                for key, value in record.items()
            }
        )
    return records


def window_peaks(
    window: list[dict[str, float]], stats: Mapping[str, float], optimizer_bytes: int
) -> list[float]:
    """This rank's peaks over a record's window of steps: the process's RSS (a high-water mark
    since it started), the framework's bytes and the CUDA allocator's peak (each reset every
    step, so the window's largest), the optimizer state now."""
    return [
        stats.get("process_peak_rss_bytes", 0),
        max(w["framework_bytes"] for w in window),
        optimizer_bytes,
        max(w["cuda_peak_bytes"] for w in window),
    ]


# The fields of a record:
#
# - ``kind``: ``"train"`` (step 1, every ``--log-every`` steps, the last step) or ``"eval"``
#   (``val_loss``, a VLM's ``digit_accuracy``; at step 0 of a fresh run, every ``--eval-every``
#   steps, the last step);
# - ``loss`` (mean over the window, global over ranks), ``lr``, ``grad_norm``, ``skipped_steps``;
# - ``tokens_per_s`` and ``samples_per_s`` (global: all ranks together), ``step_s``;
# - the step-time breakdown ``compute_s`` (forward and backward, minus waits), ``comm_exposed_s``
#   (time blocked on all-gathers and reduce-scatters: ``model.stats()["comm_wait_seconds"]``),
#   ``optimizer_s`` (clipping and the optimizer step), ``other_s``; ``comm_fraction`` =
#   ``comm_exposed_s / step_s``;
# - bytes this rank sent into collectives per step (``all_gather_bytes``, ``reduce_scatter_bytes``,
#   ``all_reduce_bytes``; compressed: codes and scales), their sum ``wire_bytes``,
#   ``compression_ratio`` (``wire_bytes`` over what the same collectives would move uncompressed: 1
#   without compression), ``padding_ratio`` of the shard plan;
# - peak memory, maximum over ranks: ``peak_rss_bytes`` (the process), ``framework_bytes`` (sharded
#   parameters and gradients plus the peak of unsharded buffers), ``optimizer_bytes``, and
#   ``cuda_peak_bytes`` on GPUs (the most the allocator held during the record's window:
#   ``reset_stats`` restarts the device's peak every step, and the window takes the largest);
# - under ``--pp``, ``stages``: per pipeline rank, its ``stages``, ``step_s`` and
#   ``bubble_fraction`` (the schedule's step minus the stages' compute in it, over the step time;
#   compute timed around each chunk, the device synchronised), and beside the last stage its
#   ``loss`` (means over the ranks that hold the same stages);
# - ``comm_exposed_s`` is the compute's stall on collectives as ``model.stats()`` times it: on the
#   CPU the thread blocked in ``wait()``, on a GPU the compute stream between CUDA events around it
#   (``runtime/_metrics.py``, [Note: timing waits on an accelerator]).
class Monitor:
    """Collects step metrics on every rank and reports them from rank 0."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        rank: int,
        world_size: int,
        start_step: int,
        padding_ratio: float,
        device: torch.device,
        stages: list[int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.stages = stages  # under --pp: this rank's pipeline stages
        self.rank = rank
        self.world_size = world_size
        self.start_step = start_step
        self.padding_ratio = padding_ratio
        self.device = device
        self.out = Path(cfg.out)
        self.tokens_per_step = cfg.batch_size * cfg.tokens_per_seq
        self.started = time.perf_counter()
        self._window: list[dict[str, float]] = []
        self._skipped = 0
        self.records: list[dict[str, Any]] = []
        self._file: TextIO | None = None
        self.console: Any = None  # rich Console, rank 0 only
        self._writer: Any = None
        self._progress: Any = None
        self._task: Any = None
        if rank == 0:
            self._open(start_step)

    # -- rank 0 outputs ------------------------------------------------------------------------

    def _open(self, start_step: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        # Keep the records up to the resumed step: later ones belong to an abandoned future.
        self.records = [r for r in read_metrics(self.out) if r.get("step", 0) <= start_step]
        path = self.out / METRICS
        text = "".join(json.dumps(r) + "\n" for r in self.records)
        # Replaced, not rewritten: a link planted at its name is replaced, never followed.
        write_whole(path, lambda partial: partial.write_text(text))
        self._file = open(path, "a")  # noqa: SIM115 (held open for the run, closed in close())
        self.console = Console()
        if not self.console.is_terminal:
            # Rich falls back to 80 columns off a terminal, which wraps the summary table.
            self.console = Console(width=120)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            # A bar only on a terminal; logs and CI get the log lines alone.
            disable=not self.console.is_terminal,
        )
        self._task = self._progress.add_task(
            "train", total=self.cfg.steps, completed=start_step, info=""
        )
        self._progress.start()
        if self.cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the optional [report] extra: one line, never the exit status
                self.print("tensorboard skipped: pip install 'raggedfsdp[report]' (tensorboard)")
            else:
                out = str(self.out / "tensorboard")
                self._writer = SummaryWriter(out, purge_step=start_step + 1)

    def print(self, message: str) -> None:
        """A line on rank 0's console (above the progress bar)."""
        if self.rank == 0:
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self.records.append(record)
        self._file.write(_to_json(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def lora_bytes(
        self,
        step: int,
        measured: list[dict[str, int]],
        predicted: list[dict[str, int]],
        base_numel: int,
    ) -> None:
        """Rank 0: a LoRA run's tensor bytes per rank, measured and predicted
        (:mod:`.lora_meter`), and the elements of its NF4 base, as one record."""
        record = {"measured": measured, "predicted": predicted, "base_numel": base_numel}
        self._write({"kind": "lora_bytes", "step": step, **record})

    # -- per step (every rank) -----------------------------------------------------------------

    def step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float | None,
        times: StepTimes,
        stats: Mapping[str, float],
        optimizer_bytes: int,
        skipped: bool,
        pipeline_s: tuple[float, float] | None = None,
    ) -> None:
        """Record completed step ``step`` (1-based); at log steps, a collective on every rank.
        ``pipeline_s``: under ``--pp``, the seconds of the schedule's step and of this rank's
        stages' compute in it (the rest is their bubble)."""
        self._skipped += int(skipped)
        span, busy = pipeline_s or (math.nan, math.nan)
        self._window.append(
            {
                "bubble_fraction": (span - busy) / times.total,
                "loss": loss,
                "lr": lr,
                "grad_norm": math.nan if grad_norm is None else grad_norm,
                "step_s": times.total,
                "compute_s": times.compute,
                "comm_exposed_s": times.comm,
                "optimizer_s": times.optimizer,
                "all_gather_bytes": stats.get("all_gather_bytes", 0),
                "reduce_scatter_bytes": stats.get("reduce_scatter_bytes", 0),
                "all_reduce_bytes": stats.get("all_reduce_bytes", 0),
                "uncompressed_bytes": stats.get("all_gather_uncompressed_bytes", 0)
                + stats.get("reduce_scatter_uncompressed_bytes", 0)
                + stats.get("all_reduce_bytes", 0),
                "framework_bytes": stats.get("persistent_bytes", 0)
                + stats.get("peak_unsharded_bytes", 0),
                "cuda_peak_bytes": stats.get("cuda_max_allocated_bytes", 0),
            }
        )
        if self.rank == 0:
            info = f"loss {loss:.4f}  {self.tokens_per_step / times.total:,.0f} tok/s"
            info += f"  {times.total:.3f} s/step"
            self._progress.update(self._task, completed=step, info=info)
        # Step 1 too, so that the curves start where training starts.
        if step % self.cfg.log_every and step not in (1, self.cfg.steps):
            return
        peaks = torch.tensor(
            window_peaks(self._window, stats, optimizer_bytes),
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        window, self._window = self._window, []
        stages = self._per_stage(window) if self.stages is not None else None
        if self.rank == 0:
            self._log(step, window, peaks.tolist(), stages)

    def _per_stage(self, window: list[dict[str, float]]) -> list[dict[str, Any]]:
        """Each pipeline rank's stages, step time and bubble fraction over the window (means
        over the ranks that hold the same stages), the loss beside the last stage: gathered
        from every rank (a collective)."""
        mine = {
            "stages": self.stages,
            "step_s": statistics.fmean(w["step_s"] for w in window),
            "bubble_fraction": statistics.fmean(w["bubble_fraction"] for w in window),
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        by_stages: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        for entry in everyone:
            by_stages.setdefault(tuple(entry["stages"]), []).append(entry)
        last = max(s for entry in everyone for s in entry["stages"])
        out = []
        for stages, entries in sorted(by_stages.items()):
            record: dict[str, Any] = {"stages": list(stages)}
            for key in ("step_s", "bubble_fraction"):
                record[key] = statistics.fmean(e[key] for e in entries)
            if last in stages:
                record["loss"] = statistics.fmean(w["loss"] for w in window)
            out.append(record)
        return out

    def _log(
        self,
        step: int,
        window: list[dict[str, float]],
        peaks: list[float],
        stages: list[dict[str, Any]] | None,
    ) -> None:
        def mean(key: str) -> float:
            values = [w[key] for w in window if math.isfinite(w[key])]
            return sum(values) / len(values) if values else math.nan

        step_s = mean("step_s")
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            "loss": mean("loss"),
            "lr": window[-1]["lr"],
            "grad_norm": mean("grad_norm"),
            "skipped_steps": self._skipped,
            "tokens_per_s": self.tokens_per_step / step_s,
            "samples_per_s": self.cfg.batch_size / step_s,
            "step_s": step_s,
            "compute_s": mean("compute_s"),
            "comm_exposed_s": mean("comm_exposed_s"),
            "optimizer_s": mean("optimizer_s"),
        }
        record["other_s"] = max(
            0.0, step_s - record["compute_s"] - record["comm_exposed_s"] - record["optimizer_s"]
        )
        record["comm_fraction"] = record["comm_exposed_s"] / step_s
        for key in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes"):
            record[key] = round(mean(key))
        record["wire_bytes"] = sum(record[k] for k in _WIRE)
        # What the same collectives move compressed, over what they would move uncompressed.
        record["compression_ratio"] = record["wire_bytes"] / max(1, mean("uncompressed_bytes"))
        record["padding_ratio"] = self.padding_ratio
        rss, framework, optimizer, cuda = peaks
        record["peak_rss_bytes"] = int(rss)
        record["framework_bytes"] = int(framework)
        record["optimizer_bytes"] = int(optimizer)
        if cuda:
            record["cuda_peak_bytes"] = int(cuda)
        record["world_size"] = self.world_size
        if stages is not None:
            record["stages"] = stages
        record["elapsed_s"] = time.perf_counter() - self.started
        self._write(record)
        width = len(str(self.cfg.steps))
        self.print(
            f"step {step:>{width}}/{self.cfg.steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | "
            f"{step_s:.3f} s/step (compute {record['compute_s']:.3f}, comm "
            f"{record['comm_exposed_s']:.3f}, optim {record['optimizer_s']:.3f}) | "
            f"peak RSS {format_bytes(rss)}"
        )

    def eval(self, step: int, val_loss: float, *, digit_accuracy: float | None = None) -> None:
        """Record a validation loss, and a VLM's held-out digit accuracy (rank 0 writes; other
        ranks ignore)."""
        if self.rank != 0:
            return
        record: dict[str, Any] = {"kind": "eval", "step": step, "val_loss": val_loss}
        line = f"step {step} | val loss {val_loss:.4f}"
        if digit_accuracy is not None:
            record["digit_accuracy"] = digit_accuracy
            line += f" | held-out digit accuracy {100 * digit_accuracy:.1f}%"
        self._write(record)
        self.print(line)

    # -- the end -------------------------------------------------------------------------------

    def close(self, *, wall_s: float) -> None:
        """Stop the bar; on rank 0 print the summary table and write ``report.png``."""
        if self.rank != 0:
            return
        self._progress.stop()
        assert self._file is not None
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        train = [r for r in self.records if r["kind"] == "train"]
        evals = [r for r in self.records if r["kind"] == "eval"]
        if train:
            self.console.print(self._summary(train, evals, wall_s))
            try:
                self.print(f"report: {write_report(self.records, self.out / REPORT, self.cfg)}")
            except ImportError:  # the optional [report] extra: one line, never the exit status
                self.print(f"{REPORT} skipped: pip install 'raggedfsdp[report]' (matplotlib)")

    def _summary(self, train: list[dict], evals: list[dict], wall_s: float) -> Any:
        from rich.table import Table

        this_run = [r for r in train if r["step"] > self.start_step] or train
        table = Table(title=f"{self.cfg.model_name} on {self.world_size} rank(s): summary")
        table.add_column("metric")
        table.add_column("value", justify="right")

        def median(key: str) -> float:
            return statistics.median(r[key] for r in this_run)

        first, last = train[0], train[-1]
        rows = [
            ("steps", f"{last['step']:,} (this launch from {self.start_step:,})"),
            (
                "train loss",
                f"{first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f}",
            ),
        ]
        rows.append(("skipped steps (non-finite)", f"{last['skipped_steps']:,}"))
        rows += _eval_rows(evals)
        step_s = median("step_s")
        rows += [
            ("tokens/s (global, median)", f"{median('tokens_per_s'):,.0f}"),
            ("samples/s (global, median)", f"{median('samples_per_s'):,.1f}"),
            (
                "step time (median)",
                f"{step_s:.3f} s = compute {median('compute_s'):.3f} + comm "
                f"{median('comm_exposed_s'):.3f} + optim {median('optimizer_s'):.3f} + other",
            ),
            ("exposed comm fraction", f"{100 * median('comm_fraction'):.1f}%"),
            (
                "bytes sent / step / rank",
                f"all-gather {format_bytes(median('all_gather_bytes'))}, reduce-scatter "
                f"{format_bytes(median('reduce_scatter_bytes'))}",
            ),
            (
                "bytes on the wire / step / rank",
                f"{format_bytes(median('wire_bytes'))} (compression ratio "
                f"{median('compression_ratio'):.3f})",
            ),
            ("padding ratio", f"{100 * self.padding_ratio:.3f}%"),
            *_pipeline_rows(this_run),
            ("peak RSS (max over ranks)", format_bytes(max(r["peak_rss_bytes"] for r in train))),
            (
                "framework + optimizer bytes (max)",
                f"{format_bytes(max(r['framework_bytes'] for r in train))} + "
                f"{format_bytes(max(r['optimizer_bytes'] for r in train))}",
            ),
            ("wall time (this launch)", f"{wall_s:,.1f} s"),
        ]
        rows += _lora_rows([r for r in self.records if r["kind"] == "lora_bytes"][-1:])
        for name, value in rows:
            table.add_row(name, value)
        return table


def _pipeline_rows(train: list[dict]) -> list[tuple[str, str]]:
    """Under ``--pp``: each pipeline rank's bubble fraction (the median over the records)."""
    if "stages" not in train[-1]:
        return []
    parts = []
    for index, entry in enumerate(train[-1]["stages"]):
        fractions = [r["stages"][index]["bubble_fraction"] for r in train if "stages" in r]
        stages = ",".join(str(s) for s in entry["stages"])
        parts.append(f"stage {stages}: {100 * statistics.median(fractions):.1f}%")
    return [("pipeline bubble (median)", ", ".join(parts))]


def _lora_rows(records: list[dict]) -> list[tuple[str, str]]:
    """The summary's rows of a LoRA run's tensor bytes (its ``lora_bytes`` record, if any):
    the largest rank's, measured against predicted, and the NF4 base's bytes per parameter."""
    if not records:
        return []
    (record,) = records
    measured, predicted = record["measured"], record["predicted"]
    top = max(range(len(measured)), key=lambda r: measured[r]["total"])
    got, want = measured[top], predicted[top]
    parts = " + ".join(
        f"{name} {format_bytes(got[name])}"
        for name in ("base", "frozen", "adapters", "grads", "optimizer")
    )
    rows = [
        (
            f"LoRA tensors, rank {top} (largest)",
            f"{parts} = {format_bytes(got['total'])} (predicted {format_bytes(want['total'])}, "
            f"{got['total'] / max(1, want['total']):.3f}x)",
        )
    ]
    if record["base_numel"]:
        per_param = sum(m["base"] for m in measured) / record["base_numel"]
        rows.append(("NF4 base, bytes per parameter", f"{per_param:.4f}"))
    return rows


def _eval_rows(evals: list[dict]) -> list[tuple[str, str]]:
    """The summary's rows of the evaluations: the validation loss, a VLM's digit accuracy."""
    if not evals:
        return []
    best = min(evals, key=lambda r: r["val_loss"])
    rows = [("val loss", f"{evals[-1]['val_loss']:.4f} (best {best['val_loss']:.4f})")]
    if "digit_accuracy" in evals[-1]:
        first, last = evals[0], evals[-1]
        rows.append(
            (
                "held-out digit accuracy",
                f"{100 * first['digit_accuracy']:.1f}% (step {first['step']}) -> "
                f"{100 * last['digit_accuracy']:.1f}% (chance 10%)",
            )
        )
    return rows


def write_report(records: list[dict[str, Any]], path: Path, cfg: TrainConfig) -> Path:
    """``report.png``: loss and validation loss (and a VLM's held-out digit accuracy),
    throughput, and peak memory over steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when imported after another backend
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    steps = [r["step"] for r in train]
    fig, (ax_loss, ax_speed, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation"
        )
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.legend(loc="upper left")
    scored = [r for r in evals if "digit_accuracy" in r]
    if scored:  # a VLM's held-out digits, on a second axis
        ax_acc = ax_loss.twinx()
        ax_acc.plot(
            [r["step"] for r in scored],
            [100 * r["digit_accuracy"] for r in scored],
            "s--",
            color="tab:green",
            label="held-out digit accuracy",
        )
        ax_acc.set(ylabel="held-out digit accuracy (%)", ylim=(0, 100))
        ax_acc.legend(loc="upper right")
    ax_speed.plot(steps, [r["tokens_per_s"] for r in train], label="tokens/s")
    ax_speed.set(xlabel="step", ylabel="tokens/s (global)", title="throughput")
    ax_comm = ax_speed.twinx()
    ax_comm.plot(steps, [100 * r["comm_fraction"] for r in train], color="tab:red", alpha=0.5, lw=1)
    ax_comm.set_ylabel("exposed comm (% of step)", color="tab:red")
    ax_mem.plot(steps, [r["peak_rss_bytes"] / _MIB for r in train], label="peak RSS")
    ax_mem.plot(
        steps,
        [(r["framework_bytes"] + r["optimizer_bytes"]) / _MIB for r in train],
        label="params + grads + unsharded + optimizer",
    )
    ax_mem.set(xlabel="step", ylabel="MiB (max over ranks)", title="memory")
    ax_mem.legend(fontsize="small")
    world = train[-1]["world_size"] if train else "?"
    fig.suptitle(
        f"{cfg.model_name}, {world} rank(s), {cfg.optimizer}, block {cfg.block_size}, "
        f"batch {cfg.batch_size}x{cfg.tokens_per_seq}, mixed precision {cfg.mixed_precision}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
