"""A titan run's loss curve from its metrics.jsonl: training loss per logged step, validation loss where it ran.

    python benchmarks/plot_metrics.py outputs/debug/metrics.jsonl benchmarks/figures/titan_debug_loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(metrics: Path, out: Path, title: str) -> None:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="training loss")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", label="validation loss")
    minutes = records[-1]["elapsed_s"] / 60
    subtitle = f"{records[-1]['step']} steps, {minutes:.1f} min of training"
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{title}\n{subtitle}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--title", default="python -m titan.train", help="the plot's title")
    args = p.parse_args()
    plot(args.metrics, args.out, args.title)


if __name__ == "__main__":
    main()
