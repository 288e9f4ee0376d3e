"""Rendering of ``raggedfsdp bench`` results: rich tables for a terminal, markdown for docs/.

The results are the plain dict that :func:`raggedfsdp.bench.run_bench` returns; nothing here
measures anything. Each table's title, header and rows are built once, as a :class:`_Table`, by
:func:`_tables`; :func:`render` and :func:`render_markdown` only lay them out. The markdown report
(for docs/) has a few more tables and columns, and its own titles and column names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._console import format_bytes

__all__ = ["render", "render_markdown"]

_MIB = 1 << 20
_PHASES = ("fwd", "bwd", "opt")
_Systems = dict[str, Any]  # system name -> its results entry


def _in_mib(n: float | None) -> str:
    return format_bytes(n, "MiB", suffix=False)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _bytes_kind(entry: dict[str, Any], kind: str) -> str:
    c = entry.get("collectives", {}).get(kind)
    if not c or not c["calls"]:
        return "-"
    return f"{c['calls']} x / {c['bytes'] / _MIB:,.1f}"


@dataclass(frozen=True)
class _Table:
    """A titled table of plain strings; the first column labels the rows."""

    title: str
    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class _Col:
    """A column of a table with a row per system; a None header leaves it out of that renderer."""

    terminal: str | None
    markdown: str | None
    cell: Callable[[dict[str, Any]], str]


# The terminal gives each phase and CPU time a column of its own, plus the spread; markdown joins
# them into one column each and lists the measured step times instead.
_STEP_COLUMNS = (
    _Col("step s", "median s", lambda e: f"{e['step_s']:.3f}"),
    _Col("vs FSDP2", "vs FSDP2", lambda e: _ratio(e["vs_fsdp2"])),
    _Col("vs floor", "vs floor", lambda e: _ratio(e["vs_floor"])),
    _Col("best s", "best s", lambda e: f"{e['best_step_s']:.3f}"),
    _Col("best vs FSDP2", "best vs FSDP2", lambda e: _ratio(e["best_vs_fsdp2"])),
    _Col("paired", "per-round vs FSDP2", lambda e: _ratio(e["paired_vs_fsdp2"])),
    *(_Col(f"{k} s", None, lambda e, k=k: f"{e['phases_s'][k]:.3f}") for k in _PHASES),
    _Col(
        None, "fwd / bwd / opt s", lambda e: " / ".join(f"{e['phases_s'][k]:.3f}" for k in _PHASES)
    ),
    _Col("spread", None, lambda e: f"{100 * e['spread']:.1f}%"),
    _Col("page faults", "page faults/step", lambda e: f"{e['page_faults_per_step']:,.0f}"),
    _Col("runqueue s", "runqueue s", lambda e: f"{e['runqueue_s']:.3f}"),
    _Col("CPU s", None, lambda e: f"{e['cpu_s']:.3f}"),
    _Col("main CPU s", None, lambda e: f"{e['main_cpu_s']:.3f}"),
    _Col(
        None,
        "CPU s: process / compute thread",
        lambda e: f"{e['cpu_s']:.3f} / {e['main_cpu_s']:.3f}",
    ),
    _Col(None, "measured steps s", lambda e: ", ".join(f"{t:.2f}" for t in e["step_times_s"])),
)


def _framework_copies(entry: dict[str, Any]) -> str:
    framework = entry["copies"]["by_name"].get("framework", {})
    return ", ".join(f"{k.split('::')[-1]} {v}" for k, v in framework.items()) or "-"


_COPY_COLUMNS = (
    _Col("copies", "total", lambda e: str(e["copies"]["total"])),
    _Col("framework", "framework", lambda e: str(e["copies"]["framework"])),
    _Col("beyond floor", "beyond floor", lambda e: str(e["copies"].get("beyond_floor", "-"))),
    _Col("Gloo", "in Gloo", lambda e: str(e["copies"]["backend"])),
    _Col("optimizer", "in AdamW", lambda e: str(e["copies"]["optimizer"])),
    _Col(None, "framework copies by name", _framework_copies),
)


def _own_traffic(entry: dict[str, Any]) -> str:
    st = entry.get("runtime_stats")
    return (
        f"{_in_mib(st['all_gather_bytes'])} / {_in_mib(st['reduce_scatter_bytes'])}" if st else "-"
    )


def _own_wait(entry: dict[str, Any]) -> str:
    st = entry.get("runtime_stats")
    return f"{st['comm_wait_seconds']:.3f}" if st else "-"


_COLLECTIVE_COLUMNS = (
    _Col("all-gather", "all-gather", lambda e: _bytes_kind(e, "all_gather")),
    _Col("reduce-scatter", "reduce-scatter", lambda e: _bytes_kind(e, "reduce_scatter")),
    _Col("all-reduce", "all-reduce", lambda e: _bytes_kind(e, "all_reduce")),
    _Col(None, "own counters AG / RS MiB", _own_traffic),
    _Col(None, "own exposed wait s", _own_wait),
)


def _max_in_mib(figure: str, optional: bool = False) -> Callable[[dict[str, Any]], str]:
    """Cell of a memory figure's maximum over ranks; only raggedfsdp has the optional ones."""
    key = f"max_{figure}_bytes"
    return lambda e: _in_mib(e["memory"].get(key) if optional else e["memory"][key])


_MEMORY_COLUMNS = (
    _Col("tensor peak", "tensor peak", _max_in_mib("tensor_peak")),
    _Col("at step start", "tensors at step start", _max_in_mib("tensor_at_step_start")),
    _Col(None, "unwrapped params alive", _max_in_mib("retained_original_param")),
    _Col("peak RSS", "peak RSS", _max_in_mib("peak_rss")),
    _Col("RSS above start", "RSS above start", _max_in_mib("peak_rss_above_start")),
    _Col("framework persistent", "own persistent", _max_in_mib("framework_persistent", True)),
    _Col(
        "framework unsharded peak",
        "own unsharded peak",
        _max_in_mib("framework_peak_unsharded", True),
    ),
)


def _row_per_system(
    title: str, systems: _Systems, columns: Sequence[_Col], markdown: bool, needs: str | None = None
) -> _Table:
    """A row per system (those whose entry has ``needs``) under the columns this renderer shows."""
    shown = [(h, c.cell) for c in columns if (h := c.markdown if markdown else c.terminal)]
    entries = {name: e for name, e in systems.items() if needs is None or needs in e}
    rows = [[name, *(cell(e) for _, cell in shown)] for name, e in entries.items()]
    return _Table(title, ["system", *(h for h, _ in shown)], rows)


def _ranked(title: str, lists: dict[str, list[Any]], cell: Callable[[Any], str]) -> _Table:
    """Each system's ranked list as a column, blank where a list runs out."""
    depth = max(len(items) for items in lists.values())
    rows = [
        [str(i + 1), *(cell(items[i]) if i < len(items) else "" for items in lists.values())]
        for i in range(depth)
    ]
    return _Table(title, ["#", *lists], rows)


def _step_table(systems: _Systems, markdown: bool) -> _Table:
    if markdown:
        title = "**Step time** (slowest rank; median and best of the measured steps):"
    else:
        title = "Step time (median of measured steps, slowest rank)"
    return _row_per_system(title, systems, _STEP_COLUMNS, markdown)


def _copies_table(systems: _Systems, markdown: bool) -> _Table:
    if markdown:  # the collectives get a table of their own, see _collectives_table
        title = "**Copy-like operators per step** (one profiled step; outermost ops):"
        return _row_per_system(title, systems, _COPY_COLUMNS, markdown, needs="copies")
    title = "Per step: copy-like ops (profiled step) and collectives (calls x / MiB)"
    columns = [*_COPY_COLUMNS, *_COLLECTIVE_COLUMNS]
    return _row_per_system(title, systems, columns, markdown, needs="copies")


def _collectives_table(systems: _Systems) -> _Table:
    title = "**Collectives per step** (per rank: calls, MiB fed in):"
    return _row_per_system(title, systems, _COLLECTIVE_COLUMNS, True, needs="collectives")


def _copy_ops_table(systems: _Systems, markdown: bool) -> _Table:
    counts = {name: e.get("copies", {}).get("ops", {}) for name, e in systems.items()}
    names = sorted({op for ops in counts.values() for op in ops})
    if markdown:
        title = "Every copy-like (and fill) operator per step, nested ones included:"
    else:
        title = "Copy-like operators per step, by name (nested ones included)"
    rows = [
        [f"`{op}`" if markdown else op, *(str(ops.get(op, 0)) for ops in counts.values())]
        for op in names
    ]
    return _Table(title, ["operator", *systems], rows)


def _profiled_seconds(profile: dict[str, Any] | None, kind: str) -> str:
    """One cell of the time split; the wall time and the Gloo threads' time are outside it."""
    if profile is None:
        return "-"
    if kind == "wall":
        return f"{profile['wall_s']:.3f}"
    if kind == "comm_thread_s":
        return f"{profile.get(kind, 0.0):.3f}"
    return f"{profile['time_split_s'].get(kind, 0.0):.3f}"


def _time_split_table(systems: _Systems, markdown: bool) -> _Table:
    profiles = {name: e.get("profile") for name, e in systems.items()}
    kinds = sorted({k for p in profiles.values() if p for k in p["time_split_s"]})
    labelled = [(kind, kind) for kind in [*kinds, "wall"]]
    if markdown:  # the Gloo threads' time only made it into the docs table
        title = "**Where the profiled step's main-thread time goes** (s, profiler on):"
        labelled.append(("(Gloo ops on Gloo threads, wall)", "comm_thread_s"))
    else:
        title = "Where the profiled step's main-thread time goes (s, profiler on)"
    rows = [
        [label, *(_profiled_seconds(p, kind) for p in profiles.values())]
        for label, kind in labelled
    ]
    return _Table(title, ["kind", *systems], rows)


def _top_ops_table(systems: _Systems) -> _Table:
    return _ranked(
        "**Top operators by self CPU time** (profiled step, main thread, s):",
        {name: e.get("profile", {}).get("top_ops", []) for name, e in systems.items()},
        lambda op: f"`{op['name']}` {op['self_s']:.3f}",
    )


def _memory_table(systems: _Systems, markdown: bool) -> _Table:
    if markdown:
        title = "**Memory per rank** (MiB, max over ranks, fresh processes per system):"
    else:
        title = "Memory per rank (max over ranks; fresh processes per system), MiB"
    return _row_per_system(title, systems, _MEMORY_COLUMNS, markdown, needs="memory")


def _live_sites_table(systems: _Systems) -> _Table:
    rank0 = {name: e["memory"]["per_rank"][0] for name, e in systems.items() if "memory" in e}
    return _ranked(
        "What is live at the tensor peak (rank 0, MiB, by allocation site):",
        {name: m.get("live_at_peak_by_site", []) for name, m in rank0.items()},
        lambda site: f"`{site['site']}` {_in_mib(site['bytes'])}",
    )


def _tables(systems: _Systems, markdown: bool) -> list[_Table]:
    """The report's tables in order; the markdown one adds collectives, top ops and live sites."""
    tables = [_step_table(systems, markdown)]
    if any("copies" in e for e in systems.values()):
        tables += [_copies_table(systems, markdown), _copy_ops_table(systems, markdown)]
        if markdown:
            tables.append(_collectives_table(systems))
        tables.append(_time_split_table(systems, markdown))
        if markdown:
            tables.append(_top_ops_table(systems))
    if any("memory" in e for e in systems.values()):
        tables.append(_memory_table(systems, markdown))
        if markdown:
            tables.append(_live_sites_table(systems))
    return tables


def render(results: dict[str, Any], out: Any) -> None:
    """Print the results as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out)
    if not console.is_terminal:
        console = Console(file=out, width=160)
    env, model = results["environment"], results["model"]
    console.print(
        f"{model['name']} ({model['params']:,} parameters), W={results['options']['world']}, "
        f"batch {results['options']['batch_size']}/rank, {env['backend']} on {env['device']}, "
        f"{env['threads_per_rank']} thread/rank, torch {env['torch']}, {env['cpus']} CPUs"
    )
    for table in _tables(results["systems"], markdown=False):
        t = Table(title=table.title)
        for i, col in enumerate(table.header):
            t.add_column(col, justify="right" if i else "left")
        for row in table.rows:
            t.add_row(*row)
        console.print(t)
    for note in results["notes"]:
        console.print(f"- {note}")
    console.print(f"command: {results['command']}   wall: {results['wall_seconds']:.0f} s")


def _md_table(table: _Table) -> list[str]:
    align = ["---" if i == 0 else "---:" for i in range(len(table.header))]
    lines = [table.title, "", "| " + " | ".join(table.header) + " |"]
    lines.append("| " + " | ".join(align) + " |")
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return [*lines, ""]


def render_markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (for docs/results/runtime.md)."""
    env, model, opts = results["environment"], results["model"], results["options"]
    lines = [
        f"`{results['command']}` — {model['name']} ({model['params']:,} parameters: "
        f"d={model['d_model']}, {model['n_layer']} layers, {model['n_head']} heads, vocab "
        f"{model['vocab_size']}, seq {model['seq_len']}), W={opts['world']}, batch "
        f"{opts['batch_size']}/rank, AdamW fp32, {env['backend']} on {env['device']}, "
        f"{env['threads_per_rank']} thread/rank, {env['cpus']} CPUs, torch {env['torch']}; "
        f"{opts['warmup']} warm-up + {opts['steps']} measured steps per system, interleaved; "
        f"load average (1/5/15 min) {env['loadavg_before_timing']} before and "
        f"{env['loadavg_after_timing']} after the timing phase; whole run "
        f"{results['wall_seconds']:.0f} s.",
        "",
    ]
    for table in _tables(results["systems"], markdown=True):
        lines += _md_table(table)
    targets = results.get("targets", {})
    if targets:
        st = targets["step_ratio"]
        lines += [
            "**Targets** (raggedfsdp zero copy against FSDP2):",
            "",
            f"- step-time ratio {st['value']:.3f} (best-step ratio {st['best_value']:.3f}, "
            f"median per-round ratio {st['paired_value']:.3f}), "
            f"target <= {st['target']:.2f}: {'met' if st['met'] else 'missed'}",
        ]
        if "peak_memory" in targets:
            pm = targets["peak_memory"]
            lines.append(
                f"- peak tensor memory per rank {_in_mib(pm['value_bytes'])} MiB vs FSDP2 "
                f"{_in_mib(pm['fsdp2_bytes'])} MiB (ratio {pm['ratio']:.3f}), target <= FSDP2: "
                f"{'met' if pm['met'] else 'missed'}"
            )
        lines.append("")
    lines += ["Notes:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"
