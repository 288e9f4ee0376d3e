"""Rendering of ``raggedfsdp bench`` results: rich tables for a terminal, markdown for docs/.

The results are the plain dict that :func:`raggedfsdp.bench.run_bench` returns; nothing here
measures anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["render", "render_markdown"]

_MIB = 1 << 20


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / _MIB:,.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _bytes_kind(entry: dict[str, Any], kind: str) -> str:
    c = entry.get("collectives", {}).get(kind)
    if not c or not c["calls"]:
        return "-"
    return f"{c['calls']} x / {c['bytes'] / _MIB:,.1f}"


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
    systems = results["systems"]
    t = Table(title="Step time (median of measured steps, slowest rank)")
    cols = ("system", "step s", "vs FSDP2", "vs floor", "best s", "best vs FSDP2", "paired")
    cols += (
        "fwd s",
        "bwd s",
        "opt s",
        "spread",
        "page faults",
        "runqueue s",
        "CPU s",
        "main CPU s",
    )
    for col in cols:
        t.add_column(col, justify="left" if col == "system" else "right")
    for name, e in systems.items():
        t.add_row(
            name,
            f"{e['step_s']:.3f}",
            _ratio(e["vs_fsdp2"]),
            _ratio(e["vs_floor"]),
            f"{e['best_step_s']:.3f}",
            _ratio(e["best_vs_fsdp2"]),
            _ratio(e["paired_vs_fsdp2"]),
            f"{e['phases_s']['fwd']:.3f}",
            f"{e['phases_s']['bwd']:.3f}",
            f"{e['phases_s']['opt']:.3f}",
            f"{100 * e['spread']:.1f}%",
            f"{e['page_faults_per_step']:,.0f}",
            f"{e['runqueue_s']:.3f}",
            f"{e['cpu_s']:.3f}",
            f"{e['main_cpu_s']:.3f}",
        )
    console.print(t)
    if any("copies" in e for e in systems.values()):
        t = Table(title="Per step: copy-like ops (profiled step) and collectives (calls x / MiB)")
        cols = ("system", "copies", "framework", "beyond floor", "Gloo", "optimizer")
        cols += ("all-gather", "reduce-scatter", "all-reduce")
        for col in cols:
            t.add_column(col, justify="left" if col == "system" else "right")
        for name, e in systems.items():
            c = e.get("copies")
            if c is None:
                continue
            t.add_row(
                name,
                str(c["total"]),
                str(c["framework"]),
                str(c.get("beyond_floor", "-")),
                str(c["backend"]),
                str(c["optimizer"]),
                _bytes_kind(e, "all_gather"),
                _bytes_kind(e, "reduce_scatter"),
                _bytes_kind(e, "all_reduce"),
            )
        console.print(t)
        t = Table(title="Copy-like operators per step, by name (nested ones included)")
        names = sorted({n for e in systems.values() for n in e.get("copies", {}).get("ops", {})})
        t.add_column("operator")
        for name in systems:
            t.add_column(name, justify="right")
        for op in names:
            t.add_row(
                op, *(str(e.get("copies", {}).get("ops", {}).get(op, 0)) for e in systems.values())
            )
        console.print(t)
        t = Table(title="Where the profiled step's main-thread time goes (s, profiler on)")
        kinds = sorted(
            {k for e in systems.values() for k in e.get("profile", {}).get("time_split_s", {})}
        )
        t.add_column("kind")
        for name in systems:
            t.add_column(name, justify="right")
        for kind in [*kinds, "wall"]:
            row = []
            for e in systems.values():
                p = e.get("profile")
                value = (
                    None
                    if p is None
                    else (p["wall_s"] if kind == "wall" else p["time_split_s"].get(kind, 0.0))
                )
                row.append("-" if value is None else f"{value:.3f}")
            t.add_row(kind, *row)
        console.print(t)
    if any("memory" in e for e in systems.values()):
        t = Table(title="Memory per rank (max over ranks; fresh processes per system), MiB")
        cols = ("system", "tensor peak", "at step start", "peak RSS", "RSS above start")
        cols += ("framework persistent", "framework unsharded peak")
        for col in cols:
            t.add_column(col, justify="left" if col == "system" else "right")
        for name, e in systems.items():
            m = e.get("memory")
            if m is None:
                continue
            t.add_row(
                name,
                _mib(m["max_tensor_peak_bytes"]),
                _mib(m["max_tensor_at_step_start_bytes"]),
                _mib(m["max_peak_rss_bytes"]),
                _mib(m["max_peak_rss_above_start_bytes"]),
                _mib(m.get("max_framework_persistent_bytes")),
                _mib(m.get("max_framework_peak_unsharded_bytes")),
            )
        console.print(t)
    for note in results["notes"]:
        console.print(f"- {note}")
    console.print(f"command: {results['command']}   wall: {results['wall_seconds']:.0f} s")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---" if i == 0 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def render_markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (for docs/runtime.md)."""
    env, model, opts = results["environment"], results["model"], results["options"]
    systems = results["systems"]
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
        "**Step time** (slowest rank; median and best of the measured steps):",
        "",
    ]
    rows = []
    for name, e in systems.items():
        rows.append(
            [
                f"{name}",
                f"{e['step_s']:.3f}",
                _ratio(e["vs_fsdp2"]),
                _ratio(e["vs_floor"]),
                f"{e['best_step_s']:.3f}",
                _ratio(e["best_vs_fsdp2"]),
                _ratio(e["paired_vs_fsdp2"]),
                " / ".join(f"{e['phases_s'][k]:.3f}" for k in ("fwd", "bwd", "opt")),
                f"{e['page_faults_per_step']:,.0f}",
                f"{e['runqueue_s']:.3f}",
                f"{e['cpu_s']:.3f} / {e['main_cpu_s']:.3f}",
                ", ".join(f"{t:.2f}" for t in e["step_times_s"]),
            ]
        )
    header = ["system", "median s", "vs FSDP2", "vs floor", "best s", "best vs FSDP2"]
    header += ["per-round vs FSDP2"]
    header += ["fwd / bwd / opt s", "page faults/step", "runqueue s"]
    header += ["CPU s: process / compute thread", "measured steps s"]
    lines += _md_table(header, rows)
    if any("copies" in e for e in systems.values()):
        lines += ["**Copy-like operators per step** (one profiled step; outermost ops):", ""]
        rows = []
        for name, e in systems.items():
            c = e.get("copies")
            if c is None:
                continue
            framework = c["by_name"].get("framework", {})
            rows.append(
                [
                    name,
                    str(c["total"]),
                    str(c["framework"]),
                    str(c.get("beyond_floor", "-")),
                    str(c["backend"]),
                    str(c["optimizer"]),
                    ", ".join(f"{k.split('::')[-1]} {v}" for k, v in framework.items()) or "-",
                ]
            )
        header = ["system", "total", "framework", "beyond floor", "in Gloo", "in AdamW"]
        lines += _md_table([*header, "framework copies by name"], rows)
        names = sorted({n for e in systems.values() for n in e.get("copies", {}).get("ops", {})})
        rows = [
            [
                f"`{op}`",
                *(str(e.get("copies", {}).get("ops", {}).get(op, 0)) for e in systems.values()),
            ]
            for op in names
        ]
        lines += ["Every copy-like (and fill) operator per step, nested ones included:", ""]
        lines += _md_table(["operator", *systems], rows)
        lines += ["**Collectives per step** (per rank: calls, MiB fed in):", ""]
        rows = []
        for name, e in systems.items():
            if "collectives" not in e:
                continue
            st = e.get("runtime_stats")
            own = (
                f"{st['all_gather_bytes'] / _MIB:,.1f} / {st['reduce_scatter_bytes'] / _MIB:,.1f}"
                if st
                else "-"
            )
            wait = f"{st['comm_wait_seconds']:.3f}" if st else "-"
            rows.append(
                [
                    name,
                    _bytes_kind(e, "all_gather"),
                    _bytes_kind(e, "reduce_scatter"),
                    _bytes_kind(e, "all_reduce"),
                    own,
                    wait,
                ]
            )
        header = ["system", "all-gather", "reduce-scatter", "all-reduce"]
        header += ["own counters AG / RS MiB", "own exposed wait s"]
        lines += _md_table(header, rows)
        kinds = sorted(
            {k for e in systems.values() for k in e.get("profile", {}).get("time_split_s", {})}
        )
        rows = []
        for kind in [*kinds, "wall", "comm_thread_s"]:
            row = [kind if kind != "comm_thread_s" else "(Gloo ops on Gloo threads, wall)"]
            for e in systems.values():
                p = e.get("profile")
                if p is None:
                    row.append("-")
                    continue
                value = p.get(kind) if kind in ("wall_s", "comm_thread_s") else None
                if kind == "wall":
                    value = p["wall_s"]
                elif value is None:
                    value = p["time_split_s"].get(kind, 0.0)
                row.append(f"{value:.3f}")
            rows.append(row)
        lines += ["**Where the profiled step's main-thread time goes** (s, profiler on):", ""]
        lines += _md_table(["kind", *systems], rows)
        top = max(len(e.get("profile", {}).get("top_ops", [])) for e in systems.values())
        rows = []
        for i in range(top):
            row = [str(i + 1)]
            for e in systems.values():
                ops = e.get("profile", {}).get("top_ops", [])
                row.append(f"`{ops[i]['name']}` {ops[i]['self_s']:.3f}" if i < len(ops) else "")
            rows.append(row)
        lines += ["**Top operators by self CPU time** (profiled step, main thread, s):", ""]
        lines += _md_table(["#", *systems], rows)
    if any("memory" in e for e in systems.values()):
        rows = []
        for name, e in systems.items():
            m = e.get("memory")
            if m is None:
                continue
            rows.append(
                [
                    name,
                    _mib(m["max_tensor_peak_bytes"]),
                    _mib(m["max_tensor_at_step_start_bytes"]),
                    _mib(m["max_retained_original_param_bytes"]),
                    _mib(m["max_peak_rss_bytes"]),
                    _mib(m["max_peak_rss_above_start_bytes"]),
                    _mib(m.get("max_framework_persistent_bytes")),
                    _mib(m.get("max_framework_peak_unsharded_bytes")),
                ]
            )
        header = ["system", "tensor peak", "tensors at step start", "unwrapped params alive"]
        header += ["peak RSS", "RSS above start", "own persistent", "own unsharded peak"]
        lines += ["**Memory per rank** (MiB, max over ranks, fresh processes per system):", ""]
        lines += _md_table(header, rows)
        with_sites = {n: e["memory"]["per_rank"][0] for n, e in systems.items() if "memory" in e}
        depth = max(len(m.get("live_at_peak_by_site", [])) for m in with_sites.values())
        rows = []
        for i in range(depth):
            row = [str(i + 1)]
            for m in with_sites.values():
                sites = m.get("live_at_peak_by_site", [])
                row.append(
                    f"`{sites[i]['site']}` {_mib(sites[i]['bytes'])}" if i < len(sites) else ""
                )
            rows.append(row)
        lines += ["What is live at the tensor peak (rank 0, MiB, by allocation site):", ""]
        lines += _md_table(["#", *with_sites], rows)
    targets = results.get("targets", {})
    if targets:
        lines += ["**Targets** (raggedfsdp zero copy against FSDP2):", ""]
        st = targets["step_ratio"]
        lines.append(
            f"- step-time ratio {st['value']:.3f} (best-step ratio {st['best_value']:.3f}, "
            f"median per-round ratio {st['paired_value']:.3f}), "
            f"target <= {st['target']:.2f}: {'met' if st['met'] else 'missed'}"
        )
        if "peak_memory" in targets:
            pm = targets["peak_memory"]
            lines.append(
                f"- peak tensor memory per rank {_mib(pm['value_bytes'])} MiB vs FSDP2 "
                f"{_mib(pm['fsdp2_bytes'])} MiB (ratio {pm['ratio']:.3f}), target <= FSDP2: "
                f"{'met' if pm['met'] else 'missed'}"
            )
        lines.append("")
    lines += ["Notes:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"
