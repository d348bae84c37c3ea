"""The report of a sweep: the console table, results.json and results.png (accuracy vs cost, speed-ups)."""

from __future__ import annotations

import json
from pathlib import Path

from morphens.config import RunConfig, to_dict


def write(cfg: RunConfig, results: list[dict]) -> Path:
    """results.json (the config and every method's record) and results.png under `run.out`; returns the folder."""
    out = Path(cfg.run.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": to_dict(cfg), "results": results}, indent=1))
    plot(results, out / "results.png")
    return out


def table(results: list[dict]) -> str:
    lines = [f"{'K':>4} {'method':<12} {'member acc':>10} {'ensemble':>9} {'GFLOPs':>9} {'wall s':>8} {'cpu s':>8} "
             f"{'cost x':>7} {'wall x':>7} {'cpu x':>7}"]
    for r in results:
        mean = sum(r["member_acc"]) / len(r["member_acc"])
        ratios = " ".join(f"{r[k]:>7.2f}" if k in r else f"{'':>7}" for k in ("cost_ratio", "wall_ratio", "cpu_ratio"))
        lines.append(f"{r['ensemble_size']:>4} {r['method']:<12} {mean:>9.2f}% {r['ensemble_acc']:>8.2f}% "
                     f"{r['train_cost'] / 1e9:>9.1f} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {ratios}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Labels go below independent points and above MotherNets ones: at K = 1 the two methods are the same point.
    for method, marker, label_dy in (("independent", "s", -10), ("mothernets", "o", 4)):
        rows = [r for r in results if r["method"] == method]
        if not rows:
            continue
        left.plot([r["train_cost"] / 1e12 for r in rows], [r["ensemble_acc"] for r in rows], marker=marker,
                  label=method)
        for r in rows:
            left.annotate(f"K={r['ensemble_size']}", (r["train_cost"] / 1e12, r["ensemble_acc"]), fontsize=8,
                          textcoords="offset points", xytext=(4, label_dy))
    left.set(xscale="log", xlabel="training cost (TFLOPs)", ylabel="ensemble accuracy (%)",
             title="Ensemble accuracy vs training cost")
    # Ticks at 1, 2 and 5 per decade, as plain numbers: a sweep often spans less than one decade of cost.
    left.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.margins(x=0.12)  # room for the last point's label
    left.legend()
    mn = [r for r in results if "cost_ratio" in r]
    if mn:
        ks = [r["ensemble_size"] for r in mn]
        right.plot(ks, [r["cost_ratio"] for r in mn], marker="o", label="FLOPs")
        right.plot(ks, [r["wall_ratio"] for r in mn], marker="s", label="wall time")
        right.plot(ks, [r["cpu_ratio"] for r in mn], marker="^", label="CPU time")
        right.axhline(1.0, color="gray", lw=0.8)
        right.set(xscale="log", xlabel="ensemble size K", ylabel="independent / MotherNets",
                  title="Training speed-up of MotherNets")
        right.set_xticks(ks, [str(k) for k in ks])
        right.minorticks_off()
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
