"""`python -m morphens.run [--config PATH.toml] [--sizes 1,2,4,8] [--section.key value ...]`

Trains an ensemble with MotherNets (cluster, build and train one mother per cluster, hatch and briefly train each
member) and, unless `--run.baseline false`, the same members independently; prints a table and writes
`results.json` and `results.png` (ensemble accuracy vs training cost) under `run.out`. Under torchrun,
`--training.spread members` trains the members one per rank (mothers still use all ranks).
"""

from __future__ import annotations

import os

from morphens import report
from morphens.config import RunConfig, help_text, load_config
from morphens.experiment import experiment, prepare
from titan.config.manager import split_cli
from titan.tools.cli import UserError, entry_point, run


def parse(argv: list[str]) -> RunConfig:
    path, overrides = split_cli(argv)
    return load_config(path, [("run.sizes" if name == "sizes" else name, value) for name, value in overrides])


@entry_point
def main(argv: list[str]) -> int:
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
        print(f"wrote {out / 'results.json'} and {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    run(main)
