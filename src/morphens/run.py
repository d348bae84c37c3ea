"""`python -m morphens.run [--quick] [--config PATH.toml] [--sizes 1,2,4,8] [--section.key value ...]`

Trains an ensemble with each method of `run.methods` (default MotherNets and the independent baseline; `snapshot`
adds Snapshot Ensembles, `matched_snapshot` one whose chain takes about MotherNets' time) at every ensemble size
and budget of the sweep, side by side; prints a table and writes
`results.json` and `results.png` (ensemble accuracy vs wall-clock time and vs FLOPs) under `run.out`.
`--quick` is a tiny digits run of all three methods (under a minute); options after it override it. Under
torchrun, `--training.spread members` deals the mothers (with their snapshot cycles), then the members, out over
the ranks by cost, each trained on its rank alone; rank 0 writes the results.
"""

from __future__ import annotations

import os
import time

from morphens import report
from morphens.config import RunConfig, help_text, load_config
from morphens.experiment import experiment, prepare
from morphens.records import MethodResult
from titan.config.manager import split_cli
from titan.tools.cli import UserError, entry_point, report_done, run

QUICK = ["--data.dataset", "digits", "--ensemble.size", "4", "--ensemble.blocks", "2", "--ensemble.width", "4",
         "--training.engine", "local", "--training.epochs", "3", "--training.batch_size", "128",
         "--mothernet.mother_epochs", "4", "--mothernet.hatch_epochs", "1", "--snapshot.cycle_epochs", "1",
         "--run.methods", "mothernets,independent,snapshot", "--run.out", "outputs/morphens/quick"]
"""`--quick`: digits, four small VGG members, a few epochs each, the plain local loop."""


def parse(argv: list[str]) -> RunConfig:
    if "--quick" in argv:
        argv = [*QUICK, *(a for a in argv if a != "--quick")]
    path, overrides = split_cli(argv)
    return load_config(path, [("run.sizes" if name == "sizes" else name, value) for name, value in overrides])


@entry_point
def main(argv: list[str]) -> int:
    start = time.perf_counter()
    if "-h" in argv or "--help" in argv:
        print(__doc__ + help_text())
        return 0
    try:
        cfg = parse(argv)
        prepared = prepare(cfg)
    except (ValueError, FileNotFoundError) as e:  # morphens' config and input checks raise these, before any work
        raise UserError(str(e)) from None
    writer = int(os.environ.get("RANK", "0")) == 0  # every rank holds every result (FSDP or gathered); one writes
    results = experiment(cfg, *prepared, done=lambda so_far: report.write(cfg, so_far) if writer else None)
    if writer:
        print(report.table(results))
        report_done(f"{len(results)} ensembles", time.perf_counter() - start, headline(results),
                    f"{cfg.run.out} (results.json, results.png)")
    return 0


def headline(results: list[MethodResult]) -> str:
    """Each method's ensemble accuracy at the largest ensemble size, with its wall-time ratio where it has one."""
    k = max(r.ensemble_size for r in results)
    return f"K={k} ensemble accuracy " + ", ".join(
        f"{r.method} {r.ensemble_acc:.2f}%" + (f" ({r.speedup.wall:.2f}x less wall time)" if r.speedup else "")
        for r in results if r.ensemble_size == k)


if __name__ == "__main__":
    run(main)
