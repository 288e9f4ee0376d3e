"""Host synchronisations per training step: what the runtime makes the host wait for.

A GPT of ``--layers`` blocks (d=64, 2 heads, vocab 256, sequence 64, batch 2 per rank) wrapped
with ``rf.fully_shard`` per block and on the root, at W ranks (Gloo, one thread each), trained
with torch's AdamW. After one warm-up step (the first forward checks the plans across ranks, a
one-off), one step is counted phase by phase (forward, backward, optimizer step) with
:class:`raggedfsdp.runtime.HostSyncCounter`: the ops that would make the host wait for a GPU
(``item``/``bool``/``is_nonzero``/``equal``, data-dependent sizes, device-to-host copies). Each
compression setting runs in its own launch. One JSON object per setting, rank 0's counts (every
rank makes the same calls).

Usage::

    PYTHONPATH=src python3 benchmarks/host_syncs.py [--layers 16] [--world 2] [--json FILE]

docs/results/compression.md ("Host synchronisations") has its output before and after issue 23.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from raggedfsdp.spawn import run_on_ranks

#: The settings counted: (name, all-gather code dtype, reduce-scatter code dtype).
SETTINGS: tuple[tuple[str, torch.dtype | None, torch.dtype | None], ...] = (
    ("uncompressed", None, None),
    ("fp8 all-gather", torch.float8_e4m3fn, None),
    ("int8 reduce-scatter", None, torch.int8),
    ("fp8 all-gather + int8 reduce-scatter", torch.float8_e4m3fn, torch.int8),
)


def count_step(rank: int, world: int, layers: int, setting: int) -> dict[str, Any]:
    """Host syncs of one step's forward, backward and optimizer step (after a warm-up step)."""
    import raggedfsdp as rf
    from raggedfsdp.models import GPT
    from raggedfsdp.models.gpt import GPTConfig
    from raggedfsdp.runtime import HostSyncCounter

    name, all_gather, reduce_scatter = SETTINGS[setting]
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=layers, n_head=2, d_model=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    compression = None
    if all_gather is not None or reduce_scatter is not None:
        compression = rf.CommCompression(all_gather=all_gather, reduce_scatter=reduce_scatter)
    for block in model.blocks:
        rf.fully_shard(block, compression=compression)
    rf.fully_shard(model, compression=compression)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    counts: dict[str, Any] = {"setting": name, "layers": layers, "world": world}
    for step in range(2):
        phases = {"forward": HostSyncCounter(), "backward": HostSyncCounter()}
        phases["optimizer"] = HostSyncCounter()
        with phases["forward"]:
            loss = model(x, y)
        with phases["backward"]:
            loss.backward()
        with phases["optimizer"]:
            optimizer.step()
            optimizer.zero_grad()
        if step == 1:
            for phase, counter in phases.items():
                counts[phase] = counter.total
                counts[f"{phase}_ops"] = dict(counter.counts)
    counts["forward_backward"] = counts["forward"] + counts["backward"]
    counts["step"] = counts["forward_backward"] + counts["optimizer"]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results = []
    for setting in range(len(SETTINGS)):
        counts = run_on_ranks(count_step, args.world, args.layers, setting, backend="gloo")[0]
        results.append(counts)
        print(json.dumps(counts), flush=True)
    print("\n| setting | forward | backward | forward+backward | optimizer (AdamW) | step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['setting']} | {r['forward']} | {r['backward']} | {r['forward_backward']} | "
            f"{r['optimizer']} | {r['step']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
