"""`python -m morphens.run [--config PATH.toml] [--sizes 1,2,4,8] [--section.key value ...]`

Trains an ensemble with MotherNets (cluster, build and train one mother per cluster, hatch and briefly train each
member) and, unless `--run.baseline false`, the same members independently; prints a table and writes
`results.json` and `results.png` (ensemble accuracy vs training cost) under `run.out`. Under torchrun,
`--training.spread members` trains the members one per rank (mothers still use all ranks).
"""

from __future__ import annotations

import os
import time

from morphens import report
from morphens.config import RunConfig, help_text, load_config
from morphens.experiment import experiment, prepare
from titan.config.manager import split_cli
from titan.tools.cli import UserError, entry_point, report_done, run


def parse(argv: list[str]) -> RunConfig:
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
    results = experiment(cfg, *prepared)
    if int(os.environ.get("RANK", "0")) == 0:  # every rank holds every result (FSDP or gathered); one writes
        out = report.write(cfg, results)
        print(report.table(results))
        report_done(f"{len(results)} ensembles", time.perf_counter() - start, headline(results),
                    f"{out} (results.json, results.png)")
    return 0


def headline(results: list[dict]) -> str:
    """Each method's ensemble accuracy at the largest ensemble size, with its wall-time ratio where it has one."""
    k = max(r["ensemble_size"] for r in results)
    return f"K={k} ensemble accuracy " + ", ".join(
        f"{r['method']} {r['ensemble_acc']:.2f}%" + (f" ({r['wall_ratio']:.2f}x less wall time)" if "wall_ratio" in r
                                                       else "") for r in results if r["ensemble_size"] == k)


if __name__ == "__main__":
    run(main)
