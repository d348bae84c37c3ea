"""Recipe comparison: `python -m titan.compare --recipes baseline,+compile,+float8 [options] [base overrides]`

A recipe is a named set of `--section.key value` overrides; `+a+b` stacks the recipes a and b, `baseline` is
none. Every recipe trains the same model on the same data with the same seed as its own `python -m titan.train`
process (under torchrun with --nproc > 1). Runs go round-robin over --rounds rounds so that load changes on a
shared machine hit every recipe alike. The table (Markdown, JSON, bar-plot PNG under --out) reports per recipe:
median tokens/s per rank over the steps after --warmup (compile and allocator warm-up), median MFU, peak memory,
the loss at the last step, the largest difference of a step's loss from the first recipe's, the experts' load
imbalance (max / mean tokens per expert, median over the measured steps; MoE models only) and the speedup over the
first recipe. E.g. expert parallel against data parallel on 2 ranks:

    python -m titan.compare --recipes baseline,ep2 --nproc 2 --config configs/titan/qwen3_moe_moe_debug.toml

Options: --recipes A,B,... --recipes-file PATH.toml --steps N --rounds R --warmup W --nproc P --out DIR
--timeout S (per run).
Everything else (e.g. --config configs/titan/debug.toml --model.n_layers 2) is passed to every run; the harness
then sets training.steps, metrics.log_freq, job.dump_folder and turns off checkpoints, validation and tensorboard.
A --recipes-file holds one TOML table per recipe: a `[fast]` line, then lines like `compile.enable = true`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from titan.compat import tomllib
from titan.config import ConfigError, parse_args
from titan.tools.cli import UserError, entry_point, report_done

RECIPES: dict[str, dict[str, str]] = {
    "baseline": {},
    "compile": {"compile.enable": "true"},
    "full_ac": {"activation_checkpoint.mode": "full"},
    "selective_ac": {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"},
    "float8": {"float8.enable": "true", "float8.recipe": "tensorwise"},
    "float8_rowwise": {"float8.enable": "true", "float8.recipe": "rowwise"},
    # The two float8 implementations side by side (float8 alone picks torchao where its kernels run).
    "float8_titan": {"float8.enable": "true", "float8.recipe": "tensorwise", "float8.backend": "titan"},
    "float8_torchao": {"float8.enable": "true", "float8.recipe": "tensorwise", "float8.backend": "torchao"},
    "fp32": {"training.mixed_precision_param": "float32"},
    # Experts over 2 ranks against the data-parallel baseline on the same ranks (--nproc 2): dropless routing, so
    # the losses match.
    "ep2": {"parallelism.expert_parallel_degree": "2"},
}


class CompareError(UserError):
    """A bad recipe name, recipes file or option."""


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_cli_value(v) for v in value) + "]"
    return str(value)


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(_flatten(value, name))
        else:
            flat[name] = _cli_value(value)
    return flat


def load_recipes(path: str | None) -> dict[str, dict[str, str]]:
    """The built-in recipes plus those of a TOML file (one table per recipe, keys `section.key`)."""
    recipes = dict(RECIPES)
    if path:
        try:
            with open(path, "rb") as f:
                tables = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise CompareError(f"--recipes-file {path}: {e}") from None
        for name, table in tables.items():
            if not isinstance(table, dict):
                raise CompareError(f"--recipes-file {path}: {name!r} must be a [table] of section.key values")
            overrides = _flatten(table)
            bad = [k for k in overrides if k.count(".") != 1]
            if bad:
                raise CompareError(f"--recipes-file {path}: recipe {name!r} key {bad[0]!r} is not section.key")
            recipes[name] = overrides
    return recipes


def resolve(name: str, recipes: dict[str, dict[str, str]]) -> dict[str, str]:
    """Overrides of a recipe name: a known recipe, or known recipes joined by '+' (later ones win)."""
    if name in recipes:
        return dict(recipes[name])
    overrides: dict[str, str] = {}
    for part in filter(None, name.split("+")):
        if part not in recipes:
            raise CompareError(f"unknown recipe {part!r} in {name!r}; known: {', '.join(recipes)} "
                               "(stack them with '+', define more with --recipes-file)")
        overrides.update(recipes[part])
    if not overrides and name != "baseline":
        raise CompareError(f"recipe {name!r} names no recipe")
    return overrides


def train_command(base: list[str], overrides: dict[str, str], steps: int, folder: Path, nproc: int) -> list[str]:
    # Last on the command line, so they win: each run logs every step to its own fresh folder, and does no more.
    harness = {"training.steps": str(steps), "metrics.log_freq": "1", "job.dump_folder": str(folder),
               "checkpoint.enable": "false", "validation.enable": "false", "metrics.enable_tensorboard": "false"}
    args = [*base]
    for key, value in {**overrides, **harness}.items():
        args += [f"--{key}", value]
    launcher = [sys.executable, "-m", "titan.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "titan.train"
    ]
    return [*launcher, *args]


def check_arguments(name: str, cmd: list[str]) -> None:
    """A run's config is parsed here first, so a misspelt key stops the comparison before any run starts."""
    try:
        parse_args(cmd[cmd.index("titan.train") + 1:])
    except ConfigError as e:
        raise CompareError(f"recipe {name!r}: {e}") from None


def _error_line(log: str, returncode: int) -> str:
    """The most telling line of a failed run: our one-line `error:`, else the last exception, else the tail."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for pattern in (r"^error: ", r"^[\w.]+(Error|Exception): "):
        hits = [ln for ln in lines if re.match(pattern, ln)]
        if hits:
            return hits[-1]
    return lines[-1] if lines else f"exit code {returncode}"


def run_once(cmd: list[str], folder: Path, timeout: float | None = None) -> dict[str, Any]:
    """Runs one training process in a fresh folder (its output goes to train.log there); returns its per-step
    records or its error."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log_path = folder / "train.log"
    start = time.perf_counter()
    with log_path.open("w") as log:
        # A session of its own, so a timeout also ends torchrun's workers.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"ok": False, "wall_s": time.perf_counter() - start, "error": f"timed out after {timeout:.0f}s"}
        except BaseException:  # Ctrl-C or SIGTERM: the run is in a session of its own, so end it too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.perf_counter() - start
    metrics = folder / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        return {"ok": False, "wall_s": wall, "error": _error_line(log_path.read_text(), proc.returncode)}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"ok": True, "wall_s": wall, "records": records}


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(name: str, overrides: dict[str, str], runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One table row from a recipe's runs."""
    row: dict[str, Any] = {"recipe": name, "overrides": overrides, "rounds": len(runs),
                           "wall_s": [round(r["wall_s"], 2) for r in runs]}
    failed = [r for r in runs if not r["ok"]]
    if failed:
        return {**row, "ok": False, "error": failed[0]["error"]}
    kept = [rec for r in runs for rec in r["records"] if rec["step"] > warmup]
    last = [r["records"][-1] for r in runs]
    # Seconds per measured step from the runs' elapsed_s (every step is logged), a clock of its own beside tps.
    step_s = [b["elapsed_s"] - a["elapsed_s"] for r in runs for a, b in zip(r["records"], r["records"][1:])
              if b["step"] > warmup and b["step"] == a["step"] + 1 and "elapsed_s" in a and "elapsed_s" in b]
    return {
        **row,
        "ok": True,
        "tps": _median([rec["tps"] for rec in kept]),
        "tps_per_round": [_median([rec["tps"] for rec in r["records"] if rec["step"] > warmup]) for r in runs],
        "step_s": _median(step_s),
        "mfu": _median([rec.get("mfu") for rec in kept]),
        "tflops": _median([rec.get("tflops") for rec in kept]),
        "memory_gib": max(rec["memory_gib"] for r in runs for rec in r["records"]),
        "final_step": last[0]["step"],
        "final_loss": _median([rec["loss"] for rec in last]),
        "losses": [_median([r["records"][i]["loss"] for r in runs])
                   for i in range(min(len(r["records"]) for r in runs))],
        **{k: _median([rec.get(k) for rec in kept]) for k in ("moe_imbalance", "moe_imbalance_all_layers")},
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's speedup and largest loss difference (any step) against the first row."""
    base, base_losses = rows[0].get("tps"), rows[0].get("losses")
    for row in rows:
        row["speedup"] = row["tps"] / base if row.get("ok") and base else None
        row["max_loss_diff"] = (max(abs(a - b) for a, b in zip(row["losses"], base_losses))
                                if row.get("ok") and base_losses else None)


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    moe = any(r.get("moe_imbalance") is not None for r in rows)
    names = ["recipe", "tokens/s/rank", "MFU %", "peak memory GiB", "loss @ last step", "max loss diff vs first",
             *(["MoE imbalance (worst layer)", "MoE imbalance (all layers)"] if moe else []), "speedup"]
    lines = ["| " + " | ".join(names) + " |", "|---" + "|---:" * (len(names) - 1) + "|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['recipe']} | failed: {r['error'].replace('|', '/')} |" + " |" * (len(names) - 2))
            continue
        cells = [r["recipe"], _fmt(r["tps"], ",.0f"), _fmt(r["mfu"], ".2f"), _fmt(r["memory_gib"], ".2f"),
                 _fmt(r["final_loss"], ".4f"), _fmt(r["max_loss_diff"], ".2e"),
                 *([_fmt(r["moe_imbalance"], ".3f"), _fmt(r["moe_imbalance_all_layers"], ".3f")] if moe else []),
                 _fmt(r["speedup"], ".2f") + "x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["ok"]]
    names = [r["recipe"] for r in ok]
    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ok) + 4), 4))
    bars = ax_tps.bar(names, [r["tps"] for r in ok], color="tab:blue")
    ax_tps.bar_label(bars, labels=[_fmt(r["speedup"], ".2f") + "x" for r in ok])
    ax_tps.set_ylabel("tokens/s per rank (median)")
    ax_tps.margins(y=0.15)
    ax_mem.bar(names, [r["memory_gib"] for r in ok], color="tab:orange")
    ax_mem.set_ylabel("peak memory (GiB)")
    for ax in (ax_tps, ax_mem):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(textwrap.fill(title, 100), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(recipe_names: list[str], base: list[str], out: Path, steps: int = 20, rounds: int = 2,
            warmup: int = 3, nproc: int = 1, recipes_file: str | None = None, timeout: float | None = None,
            log=print) -> list[dict[str, Any]]:
    """Runs the recipes round-robin and writes results.{json,md,png} under `out`; returns the table rows."""
    if steps <= warmup:
        raise CompareError(f"--steps {steps} must exceed --warmup {warmup} so some steps are measured")
    if rounds < 1 or nproc < 1 or warmup < 0:
        raise CompareError("--rounds and --nproc must be >= 1 and --warmup >= 0")
    table = load_recipes(recipes_file)
    recipes = {name: resolve(name, table) for name in recipe_names}
    for name, overrides in recipes.items():
        check_arguments(name, train_command(base, overrides, steps, out, nproc))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in recipes}
    for round_index in range(rounds):
        for i, (name, overrides) in enumerate(recipes.items()):
            folder = out / "runs" / f"{i:02d}-{name.strip('+').replace('+', '_') or 'recipe'}" / f"round-{round_index}"
            result = run_once(train_command(base, overrides, steps, folder, nproc), folder, timeout)
            runs[name].append(result)
            status = "ok" if result["ok"] else f"failed: {result['error']}"
            log(f"round {round_index + 1}/{rounds} {name}: {result['wall_s']:.1f}s {status}")
    rows = [summarize(name, recipes[name], runs[name], warmup) for name in recipes]
    add_speedups(rows)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"base_overrides": base, "steps": steps, "rounds": rounds, "warmup": warmup, "nproc": nproc}
    (out / "results.json").write_text(json.dumps({**meta, "recipes": rows}, indent=1))
    md = markdown_table(rows)
    header = (f"Recipes on `{' '.join(base) or 'defaults'}`: {steps} steps x {rounds} rounds, "
              f"{nproc} process(es), medians over steps > {warmup}.")
    (out / "results.md").write_text(f"{header}\n\n{md}\n")
    bar_plot(rows, out / "results.png", header.replace("`", ""))
    return rows


@entry_point
def main(argv: list[str]) -> int:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(prog="python -m titan.compare", allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="baseline,+compile",
                        help=f"comma-separated recipe names; built in: {', '.join(RECIPES)}")
    parser.add_argument("--recipes-file", default=None, help="TOML file with more recipes")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="round-robin repetitions of every recipe")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun when > 1)")
    parser.add_argument("--out", default="outputs/compare", help="folder for results.{md,json,png} and runs/")
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which a run counts as failed")
    args, base = parser.parse_known_args(argv)
    rows = compare([n.strip() for n in args.recipes.split(",") if n.strip()], base, Path(args.out),
                   args.steps, args.rounds, args.warmup, args.nproc, args.recipes_file, args.timeout)
    print(markdown_table(rows))
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(f"{len(failed)} of {len(rows)} recipes failed (first: {failed[0]['recipe']}: {failed[0]['error']}); "
              f"their logs are under {args.out}/runs/", file=sys.stderr)
    best = max((r for r in rows if r["ok"] and r["speedup"] is not None), key=lambda r: r["speedup"], default=None)
    figure = f"fastest {best['recipe']} at {best['speedup']:.2f}x the first" if best else "no recipe finished"
    report_done(f"{len(rows)} recipes x {args.rounds} rounds", time.perf_counter() - start, figure,
                f"{args.out} (results.md, results.json, results.png, runs/)")
    return 1 if failed else 0

