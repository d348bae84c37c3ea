"""The report of a sweep: the console table, results.json and results.png (ensemble accuracy against wall-clock
training time and against training FLOPs: the accuracy-time frontier of each method)."""

from __future__ import annotations

import json
from pathlib import Path

from morphens.config import RunConfig, to_dict
from morphens.records import MethodResult

MARKERS = {"mothernets": "o", "independent": "s", "snapshot": "^", "matched_snapshot": "v"}


def write(cfg: RunConfig, results: list[MethodResult]) -> Path:
    """results.json (the config and every method's record) and results.png under `run.out`; returns the folder."""
    out = Path(cfg.run.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [r.to_json() for r in results]
    (out / "results.json").write_text(json.dumps({"config": to_dict(cfg), "results": records}, indent=1))
    plot(results, out / "results.png")
    return out


def merge(paths: list[str], out: str, cpu: bool = False) -> list[MethodResult]:
    """The records of several runs' results.json files (a frontier's budgets run in separate processes, say),
    plotted together into `out`/results.png (against CPU seconds instead of wall seconds with `cpu`, for runs on
    a loaded machine); returns them in the files' order."""
    results = [MethodResult.from_json(row) for path in paths
               for row in json.loads(Path(path).read_text())["results"]]
    Path(out).mkdir(parents=True, exist_ok=True)
    plot(results, Path(out) / "results.png", cpu)
    return results


def table(results: list[MethodResult]) -> str:
    """One row per method, size and budget; the speed-up columns (independent over this method) where the
    baseline ran beside it."""
    lines = [f"{'K':>4} {'budget':>6} {'method':<16} {'member acc':>10} {'ensemble':>9} {'GFLOPs':>9} {'wall s':>8} "
             f"{'cpu s':>8} {'cost x':>7} {'wall x':>7} {'cpu x':>7}"]
    for r in results:
        mean = sum(r.member_acc) / len(r.member_acc)
        s = r.speedup
        ratios = " ".join(f"{v:>7.2f}" for v in (s.cost, s.wall, s.cpu)) if s else " ".join([f"{'':>7}"] * 3)
        lines.append(f"{r.ensemble_size:>4} {r.budget:>6g} {r.method:<16} {mean:>9.2f}% {r.ensemble_acc:>8.2f}% "
                     f"{r.train_cost / 1e9:>9.1f} {r.wall_s:>8.1f} {r.cpu_s:>8.1f} {ratios}")
    return "\n".join(lines)


def plot(results: list[MethodResult], path: Path, cpu: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = sorted({r.ensemble_size for r in results})
    budgets = sorted({r.budget for r in results})

    def label(r: MethodResult) -> str:
        return " ".join(([f"K={r.ensemble_size}"] if len(sizes) > 1 else [])
                        + ([f"x{r.budget:g}"] if len(budgets) > 1 else []))

    # One line per method and size through its budgets, or per method through its sizes when there is one budget.
    series: dict[tuple, list[MethodResult]] = {}
    for r in results:
        series.setdefault((r.method, r.ensemble_size if len(budgets) > 1 else None), []).append(r)
    clock = (lambda r: r.cpu_s, "CPU") if cpu else (lambda r: r.wall_s, "wall-clock")
    for ax, x_of, xlabel in ((left, clock[0], f"{clock[1]} training time (s)"),
                             (right, lambda r: r.train_cost / 1e12, "training cost (TFLOPs)")):
        for (method, k), rows in series.items():
            rows = sorted(rows, key=x_of)
            name = method if k is None or len(sizes) == 1 else f"{method} K={k}"
            ax.plot([x_of(r) for r in rows], [r.ensemble_acc for r in rows], marker=MARKERS.get(method, "x"),
                    label=name)
            for r in rows:
                ax.annotate(label(r), (x_of(r), r.ensemble_acc), fontsize=7, textcoords="offset points",
                            xytext=(4, 4))
        ax.set(xscale="log", xlabel=xlabel, ylabel="ensemble accuracy (%)")
        # Ticks at 1, 2 and 5 per decade, as plain numbers: a sweep often spans less than one decade.
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.margins(x=0.12)  # room for the last point's label
        ax.legend(fontsize=8)
    left.set_title(f"Ensemble accuracy vs {clock[1]} time")
    right.set_title("Ensemble accuracy vs training FLOPs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
