"""The quick start's command (`python -m titan.train`, configs/titan/debug.toml) from one or more source trees:
wall time of the command, time to its first step, tokens/s and MFU of its logged steps, the loss.

    python benchmarks/titan_quickstart.py [--tree before=/path/to/old/checkout] [--tree after=.] [--together]
        [--out outputs/bench_quickstart] [-- overrides passed to every run]

Each tree runs its own `src` (PYTHONPATH) into its own dump folder. The runs go one after the other, or with
`--together` all at once so that other jobs' load hits them alike (they then share the cores: compare them with
each other, not with a run alone). Time to first step is from the launch until step 1's record reaches
metrics.jsonl (imports, the memory check, the build, the peak measurement and step 1 itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def launch(name: str, tree: Path, out: Path, overrides: list[str]) -> dict:
    folder = out / name
    cmd = [sys.executable, "-m", "titan.train", "--job.dump_folder", str(folder), *overrides]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "src")}
    log = (out / f"{name}.log").open("w")
    return {"name": name, "tree": str(tree), "folder": folder, "start": time.perf_counter(), "first_step_s": None,
            "proc": subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)}


def watch(runs: list[dict]) -> None:
    """Waits for every run, noting when each one's first record appears."""
    while any("wall_s" not in r for r in runs):
        for r in runs:
            metrics = r["folder"] / "metrics.jsonl"
            if r["first_step_s"] is None and metrics.is_file() and metrics.stat().st_size:
                r["first_step_s"] = time.perf_counter() - r["start"]
            if "wall_s" not in r and r["proc"].poll() is not None:
                r["wall_s"] = time.perf_counter() - r["start"]
        time.sleep(0.05)


def summary(r: dict) -> dict:
    records = [json.loads(line) for line in (r["folder"] / "metrics.jsonl").read_text().splitlines()]
    steady = [x for x in records if x["step"] > 1 and "val_loss" not in x] or records
    return {"name": r["name"], "tree": r["tree"], "returncode": r["proc"].returncode, "wall_s": r["wall_s"],
            "first_step_s": r["first_step_s"], "steps": records[-1]["step"],
            "tps_median": statistics.median(x["tps"] for x in steady),
            "mfu_median": statistics.median(x["mfu"] for x in steady) if steady[0]["mfu"] is not None else None,
            "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
            "val_loss": next((x["val_loss"] for x in reversed(records) if "val_loss" in x), None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a source tree to run (repeatable); default: this checkout")
    parser.add_argument("--together", action="store_true", help="run the trees at the same time")
    parser.add_argument("--out", default="outputs/bench_quickstart")
    args, overrides = parser.parse_known_args()
    overrides = [a for a in overrides if a != "--"]
    trees = [t.split("=", 1) for t in args.tree] or [("this", ".")]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for name, tree in trees:
        runs.append(launch(name, Path(tree), out, overrides))
        if not args.together:
            watch(runs)
    watch(runs)
    results = [summary(r) for r in runs]
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print(f"{'tree':<10}{'wall s':>8}{'1st step s':>11}{'tok/s':>8}{'MFU %':>7}  loss")
    for s in results:
        mfu = f"{s['mfu_median']:>7.1f}" if s["mfu_median"] is not None else f"{'n/a':>7}"
        val = f" (validation {s['val_loss']:.2f})" if s["val_loss"] is not None else ""
        print(f"{s['name']:<10}{s['wall_s']:>8.1f}{s['first_step_s']:>11.1f}{s['tps_median']:>8.0f}{mfu}  "
              f"{s['loss_first']:.2f} -> {s['loss_last']:.2f}{val}")
    (out / "results.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                  "overrides": overrides, "results": results}, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
