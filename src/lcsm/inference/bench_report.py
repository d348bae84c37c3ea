"""lcsm.bench's outputs: the table, the ratios, and the plot of time per token against L (log-log)."""

from __future__ import annotations

import math
from pathlib import Path


def find(records: list[dict], part: str, method: str, L: int, batch: int) -> dict | None:
    return next((r for r in records if (r["part"], r["method"], r["seq_len"], r["batch"]) == (part, method, L, batch)),
                None)


def plot(records: list[dict], path: Path) -> None:
    """One panel per part and batch; dashed guides through lazy's and flash's longest points: ∝ L and ∝ log² L."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["part"], r["batch"]) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (part, batch) in zip(axes[0], panels):
        rows = [r for r in records if (r["part"], r["batch"]) == (part, batch)]
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            ax.loglog([r["seq_len"] for r in mine], [r["us_per_token"] for r in mine], "o-", label=method)
        Ls = sorted({r["seq_len"] for r in rows})
        for method, shape, name in (("lazy", lambda L: L, "∝ L"), ("flash", lambda L: math.log2(L) ** 2, "∝ log² L")):
            mine = [r for r in rows if r["method"] == method]
            if mine and len(Ls) > 1:
                last = mine[-1]
                scale = last["us_per_token"] / shape(last["seq_len"])
                ax.loglog(Ls, [scale * shape(L) for L in Ls], "--", color="gray", lw=0.8)
                ax.annotate(name, (Ls[0], scale * shape(Ls[0])), fontsize=8, color="gray")
        ax.set(title=f"{part}, batch {batch}: time per generated token", xlabel="sequence length L",
               ylabel="µs / token")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_summary(records: list[dict]) -> list[str]:
    """flash vs lazy per part, length and batch; tiles batched over slots vs per slot."""
    lines = []
    for part, L, B in dict.fromkeys((r["part"], r["seq_len"], r["batch"]) for r in records):
        flash, lazy = find(records, part, "flash", L, B), find(records, part, "lazy", L, B)
        batched, unbatched = find(records, part, "flash_batched", L, B), find(records, part, "flash_unbatched", L, B)
        where = f"{part} L={L} B={B}"
        if flash and lazy:
            lines.append(f"{where}: flash {lazy['total_s'] / flash['total_s']:.1f}x faster than lazy"
                         + (f" (mixer {lazy['mixer_s'] / flash['mixer_s']:.1f}x)" if part == "e2e" else ""))
        if batched and unbatched:
            lines.append(f"{where}: tiles batched over slots {unbatched['mixer_s'] / batched['mixer_s']:.2f}x "
                         "faster (mixer time) than per-slot tiles")
    return lines


def print_table(records: list[dict]) -> None:
    print(f"{'part':6} {'method':16} {'B':>2} {'L':>7} {'mixer_s':>9} {'total_s':>9} {'us/tok':>9} {'rest/tok':>9} "
          f"{'vs lazy':>8} {'err':>9}")
    for r in records:
        lazy = find(records, r["part"], "lazy", r["seq_len"], r["batch"])
        ratio = f"{lazy['total_s'] / r['total_s']:8.1f}" if lazy else f"{'-':>8}"
        rest = (r["total_s"] - r["mixer_s"]) / (r["seq_len"] - 1) * 1e6
        print(f"{r['part']:6} {r['method']:16} {r['batch']:2d} {r['seq_len']:7d} {r['mixer_s']:9.3f} "
              f"{r['total_s']:9.3f} {r['us_per_token']:9.1f} {rest:9.1f} {ratio} {r['max_abs_err']:9.1e}")


def print_tiles(records: list[dict]) -> None:
    """flash's plan per run: its block and step, the tau per tile size (hybrid's timed choice), the slot batching."""
    for r in records:
        if r["method"] == "flash" and r.get("tiles") is not None:
            plan = ", ".join(f"{U}: {how}" for U, how in r["tiles"].items()) or "none"
            print(f"  tiles of {r['part']} {r['method']} B={r['batch']} L={r['seq_len']} (block {r.get('block')}, "
                  f"step: {r.get('step')}): {plan}")


def model_table(records: list[dict]) -> list[str]:
    """lcsm.bench --model: per length, flash's and lazy's time per token and tokens per second (lazy's extrapolated
    ones marked *), their ratio, and flash's time per token against its shortest length's."""
    lines = [f"{'L':>7} {'flash us/tok':>12} {'flash tok/s':>11} {'lazy us/tok':>12} {'lazy tok/s':>11} "
             f"{'lazy/flash':>10} {'flash vs first':>14} {'flash err':>9}"]
    flash = sorted((r for r in records if r["method"] == "flash"), key=lambda r: r["seq_len"])
    for r in flash:
        lazy = find(records, "e2e", "lazy", r["seq_len"], r["batch"])
        mark = "*" if lazy and lazy.get("extrapolated") else " "
        lazy_cols = (f"{lazy['us_per_token']:11.0f}{mark} {1e6 / lazy['us_per_token']:10.1f}{mark} "
                     f"{lazy['us_per_token'] / r['us_per_token']:10.1f}") if lazy else f"{'-':>12} {'-':>11} {'-':>10}"
        lines.append(f"{r['seq_len']:7d} {r['us_per_token']:12.0f} {r['tokens_per_s']:11.1f} {lazy_cols} "
                     f"{r['us_per_token'] / flash[0]['us_per_token']:14.2f} {r['max_abs_err']:9.1e}")
    if any(r.get("extrapolated") for r in records):
        lines.append("* extrapolated from lazy's measured time per token (a + b L, least squares), not measured")
    return lines
