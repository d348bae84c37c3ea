"""Batch size and peak lr of one morphens method, swept side by side in one process: each method at its best.

`python benchmarks/morphens_tune.py --config configs/morphens/digits_k100.toml --role independent
--batches 32,64,128 --lrs 6e-3,1.2e-2,2.4e-2 [--size 10] [--budget 1] [--section.key value ...]`

Roles and the keys they set: `independent` training.batch_size and training.lr; `mothers` mothernet.batch_size
and mothernet.lr_factor; `hatched` mothernet.hatch_batch_size and mothernet.hatch_lr_factor; `snapshot`
snapshot.batch_size and snapshot.lr_factor (lrs are absolute; factors are lr / training.lr). Every point trains
the role's method at ensemble size `--size`; the rest of the config stays as the file has it. Prints a Markdown
table (ensemble and mean member accuracy, the role's own training seconds) and writes it with the records as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from morphens.config import load_config
from morphens.experiment import experiment, prepare
from morphens.records import MethodResult
from titan.config.manager import split_cli

ROLES = {"independent": ("independent", "training.batch_size", "training.lr"),
         "mothers": ("mothernets", "mothernet.batch_size", "mothernet.lr_factor"),
         "hatched": ("mothernets", "mothernet.hatch_batch_size", "mothernet.hatch_lr_factor"),
         "snapshot": ("snapshot", "snapshot.batch_size", "snapshot.lr_factor")}


def role_seconds(role: str, r: MethodResult, kind: str = "wall") -> float:
    """Wall (or CPU) seconds of the part of the method that the role's settings drive."""
    if role == "mothers":
        return getattr(r.time.mothers + r.time.snapshots, kind)
    if role == "hatched":
        return getattr(r.time.hatch + r.time.members, kind)
    return getattr(r.time.total(), kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--lrs", required=True)
    p.add_argument("--size", type=int, default=0, help="ensemble size (0 = the config's largest)")
    p.add_argument("--budget", type=float, default=1.0, help="factor on every epoch count")
    p.add_argument("--out", default="outputs/bench/morphens_tune")
    args, rest = p.parse_known_args()
    method, batch_key, lr_key = ROLES[args.role]
    _, overrides = split_cli(rest)
    base = load_config(args.config, overrides)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for lr in (float(x) for x in args.lrs.split(",")):
            value = lr if args.role == "independent" else lr / base.training.lr
            cfg = load_config(args.config, [*overrides, (batch_key, str(batch)), (lr_key, repr(value)),
                                            ("run.methods", method), ("run.budgets", repr(args.budget)),
                                            ("run.out", str(Path(args.out) / "nets"))])
            data, members, sizes = prepare(cfg)
            r = experiment(cfg, data, members, [args.size or max(sizes)])[0]
            rows.append({"role": args.role, "batch": batch, "lr": lr, "ensemble_acc": r.ensemble_acc,
                         "member_acc": sum(r.member_acc) / len(r.member_acc), "role_s": role_seconds(args.role, r),
                         "role_cpu_s": role_seconds(args.role, r, "cpu"), "wall_s": r.wall_s, "record": r.to_json()})
            write(args, rows)  # after every point: a long sweep stopped early keeps what it measured
    print((Path(args.out) / f"{args.role}.md").read_text())


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    lines = [f"| role | batch | peak lr | ensemble acc % | mean member acc % | {args.role} wall s | {args.role} CPU s "
             "| method wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['role']} | {r['batch']} | {r['lr']:g} | {r['ensemble_acc']:.2f} | {r['member_acc']:.2f} | "
              f"{r['role_s']:.1f} | {r['role_cpu_s']:.1f} | {r['wall_s']:.1f} |" for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.role}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{args.role}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
