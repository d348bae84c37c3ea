"""Communication per step of each parallel layout on the debug model, measured beside the analytical estimate,
and each layout's step time relative to FSDP on the same world size.

    python benchmarks/titan_comm.py [--layouts FSDP4,HSDP2x2,...] [--steps 2] [--rounds 3] [--out DIR]
                                    [--section.key value ...]

One torchrun of --nproc ranks (gloo on a CPU) builds a Trainer per layout in the same processes, so every layout
runs on the same warm interpreters. Per layout: one warm-up step, one step counted by
titan.distributed.comm_stats.CommStats on every rank, then --rounds rounds that each time --steps steps of every
layout in turn (the order rotates per round) so that load changes on a shared machine hit every layout alike.
All layouts train the same global batch (--global-batch sequences), so step times compare directly.

Expected bytes come from titan.estimate (the same dry run and formulas as `python -m titan.estimate`) for rank 0.
Both sides count payload bytes per call (the full gathered tensor for all-gather, the full input for
reduce-scatter, the tensor for all-reduce, send and recv, the local input for all-to-all): the estimator's
`bytes_per_call` uses that convention, its `wire_bytes` applies the ring factor on top, so no conversion is
needed. Measured collectives the estimator has no row for (gradient-norm and loss all-reduces, DTensor grad
reductions of replicated parameters) show as `other` with no expectation. When two estimator rows land in the
same (group, collective) bucket (e.g. FSDP and ring attention both on the cp group) they are compared together.

Writes results.json, results.md and results.png under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from titan.compare.harness import _error_line, _fmt
from titan.config import parse_args
from titan.distributed import ParallelDims
from titan.distributed.comm_stats import CommStats, group_labels
from titan.distributed.runtime import shutdown
from titan.estimate.costs import Hardware
from titan.estimate.dry_run import estimate
from titan.trainer import Trainer

# Layout name -> parallelism overrides; every layout runs the same global batch (local batch = global / dp).
LAYOUTS: dict[str, dict[str, str]] = {
    "FSDP4": {},
    "HSDP2x2": {"data_parallel_replicate_degree": "2", "data_parallel_shard_degree": "2"},
    "TP2xFSDP2": {"tensor_parallel_degree": "2"},
    "PP2xFSDP2": {"pipeline_parallel_degree": "2", "pipeline_parallel_schedule": "1F1B"},
    "CP2xFSDP2": {"context_parallel_degree": "2"},
    "TP2xCP2": {"tensor_parallel_degree": "2", "context_parallel_degree": "2", "data_parallel_shard_degree": "1"},
    "TP4": {"tensor_parallel_degree": "4"},
    "Replicate4": {"data_parallel_replicate_degree": "4", "data_parallel_shard_degree": "1"},
}
DEFAULT_LAYOUTS = "FSDP4,HSDP2x2,TP2xFSDP2,PP2xFSDP2,CP2xFSDP2,TP2xCP2,Replicate4"
BASE = ["--config", "configs/titan/debug.toml"]
# Measured kinds an estimator op covers; the others are one kind each.
COVERS = {"ring_kv": ("all_gather", "all_to_all"), "send_recv": ("send", "recv")}


def layout_args(name: str, world: int, global_batch: int, extra: list[str]) -> list[str]:
    overrides = LAYOUTS[name]
    args = [*BASE, *(a for k, v in overrides.items() for a in (f"--parallelism.{k}", v)), *extra]
    dims = ParallelDims.from_config(parse_args(args).parallelism, world)
    if global_batch % dims.dp_degree:
        raise SystemExit(f"error: --global-batch {global_batch} is not a multiple of {name}'s dp degree "
                         f"{dims.dp_degree}")
    return [*args, "--training.local_batch_size", str(global_batch // dims.dp_degree),
            "--training.global_batch_size", str(global_batch)]


def fsdp_label(dims) -> str:
    """The mesh-dimension name of the FSDP group, as titan.distributed.data_parallel picks it."""
    if not dims.fsdp_enabled:
        return "dp_replicate"
    if dims.dp_shard > 1 and dims.cp > 1:
        return "dp_shard_cp"
    return "dp_shard" if dims.dp_shard > 1 else "cp"


def expected_buckets(report: dict, dims) -> list[dict]:
    """The estimator's rows for rank 0 as {buckets: {(group label, kind)}, name, calls, bytes}."""
    rows = []
    for c in report["ranks"][0]["collectives"]:
        label = {"fsdp": fsdp_label(dims), "hsdp": "dp_replicate"}.get(c["group"], c["group"])
        kinds = COVERS.get(c["op"], (c["op"],))
        rows.append({"name": f"{c['group']}:{c['op']}", "buckets": {(label, k) for k in kinds},
                     "calls": c["calls"], "bytes": c["calls"] * c["bytes_per_call"]})
    merged: list[dict] = []
    for row in rows:
        overlapping = [m for m in merged if m["buckets"] & row["buckets"]]
        for m in overlapping:
            merged.remove(m)
            row = {"name": f"{m['name']}+{row['name']}", "buckets": m["buckets"] | row["buckets"],
                   "calls": m["calls"] + row["calls"], "bytes": m["bytes"] + row["bytes"]}
        merged.append(row)
    return merged


def compare_rows(measured: dict[tuple[str, str], dict], expected: list[dict]) -> list[dict]:
    """Measured vs expected per estimator row, then every measured bucket no row covers as `other`."""
    rows, covered = [], set()
    for e in expected:
        got = [measured[b] for b in sorted(e["buckets"]) if b in measured]
        covered |= e["buckets"]
        m_bytes = sum(g["bytes"] for g in got)
        rows.append({"collective": e["name"], "buckets": sorted("/".join(b) for b in e["buckets"]),
                     "calls": sum(g["calls"] for g in got), "bytes": m_bytes, "expected_calls": e["calls"],
                     "expected_bytes": e["bytes"], "ratio": m_bytes / e["bytes"] if e["bytes"] else None})
    for bucket, m in sorted(measured.items()):
        if bucket not in covered:
            rows.append({"collective": f"other:{bucket[0]}:{bucket[1]}", "buckets": ["/".join(bucket)],
                         "calls": m["calls"], "bytes": m["bytes"], "expected_calls": None, "expected_bytes": None,
                         "ratio": None})
    return rows


# ---------------------------------------------------------------------------------------------- worker side


def _advance(trainer, steps: int) -> None:
    trainer.config.training.steps = trainer.step + steps
    trainer.train()


def worker(args, extra: list[str]) -> None:
    world = int(os.environ["WORLD_SIZE"])
    names = args.layouts.split(",")
    total = 2 + args.rounds * args.steps
    harness = ["--training.steps", str(total), "--metrics.log_freq", str(total), "--metrics.enable_jsonl", "false",
               "--metrics.enable_tensorboard", "false", "--metrics.cpu_peak_tflops", "1.0",
               "--validation.enable", "false", "--checkpoint.enable", "false"]
    trainers, results = {}, {}
    for name in names:
        folder = Path(args.out, "runs", name)
        config = parse_args([*layout_args(name, world, args.global_batch, extra), *harness,
                             "--job.dump_folder", str(folder)])
        trainers[name] = Trainer(config)
    for name, trainer in trainers.items():
        _advance(trainer, 1)
        with CommStats(group_labels(trainer.parallel_dims)) as stats:
            _advance(trainer, 1)
        tables: list = [None] * world
        dist.all_gather_object(tables, [[*k, v["calls"], v["bytes"]] for k, v in stats.table().items()])
        results[name] = {"per_rank": tables, "step_s_rounds": []}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            _advance(trainers[name], args.steps)
            dist.barrier()
            results[name]["step_s_rounds"].append((time.perf_counter() - start) / args.steps)
    for trainer in trainers.values():
        trainer.close()
    if dist.get_rank() == 0:
        Path(args.out, "worker.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------- launcher side


def estimates(names: list[str], world: int, global_batch: int, extra: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        config = parse_args([*layout_args(name, world, global_batch, extra), "--comm.world_size", str(world)])
        dims = ParallelDims.from_config(config.parallelism, world)
        out[name] = {"dims": dims, "report": estimate(config, Hardware())}
    return out


def summarize(name: str, measured: dict, estimate: dict) -> dict:
    dims = estimate["dims"]
    rank0 = {(g, k): {"calls": c, "bytes": b} for k, g, c, b in measured["per_rank"][0]}
    rows = compare_rows(rank0, expected_buckets(estimate["report"], dims))
    return {"layout": name, "overrides": LAYOUTS[name],
            "dims": {k: getattr(dims, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")},
            "step_s_rounds": measured["step_s_rounds"], "step_s": statistics.median(measured["step_s_rounds"]),
            "bytes_rank0": sum(r["bytes"] for r in rows),
            "expected_bytes_rank0": sum(r["expected_bytes"] or 0 for r in rows),
            "collectives": rows,
            "per_rank": [{f"{k}:{g}": {"calls": c, "bytes": b} for k, g, c, b in t} for t in measured["per_rank"]]}


def _mib(value) -> str:
    return _fmt(None if value is None else value / 2**20, ".3f")


def markdown(rows: list[dict]) -> str:
    lines = [f"| layout | step time vs {rows[0]['layout']} | collective (group:op) | calls | MiB/step measured | "
             "MiB/step expected | measured/expected |", "|---|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        first = True
        for c in row["collectives"]:
            head = (f"| {row['layout']} | {_fmt(row['step_ratio'], '.2f')}x" if first else "| |")
            lines.append(f"{head} | {c['collective']} | {c['calls']} | {_mib(c['bytes'])} | "
                         f"{_mib(c['expected_bytes'])} | {_fmt(c['ratio'], '.3f')} |")
            first = False
        lines.append(f"| | | **total (rank 0)** | | **{_mib(row['bytes_rank0'])}** | "
                     f"**{_mib(row['expected_bytes_rank0'])}** | |")
    return "\n".join(lines)


def bar_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["layout"] for r in rows]
    kinds = sorted({b.split("/")[1] for r in rows for c in r["collectives"] for b in c["buckets"]})
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(max(10, 1.5 * len(rows) + 5), 4.5))
    bottom = [0.0] * len(rows)
    for kind in kinds:
        heights = [sum(v["bytes"] for k, v in r["per_rank"][0].items() if k.startswith(kind + ":")) / 2**20
                   for r in rows]
        ax_b.bar(names, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_b.scatter(names, [r["expected_bytes_rank0"] / 2**20 for r in rows], color="black", marker="_", s=400,
                 zorder=3, label="expected (estimator)")
    ax_b.set_ylabel("MiB per step, rank 0 (payload)")
    ax_b.set_ylim(top=1.1 * max(bottom + [r["expected_bytes_rank0"] / 2**20 for r in rows]))
    ax_b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bars = ax_t.bar(names, [r["step_ratio"] for r in rows], color="tab:gray")
    ax_t.bar_label(bars, labels=[f"{r['step_ratio']:.2f}x" for r in rows])
    ax_t.set_ylabel(f"step time / {names[0]} step time (median)")
    ax_t.margins(y=0.15)
    for ax in (ax_b, ax_t):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def launch(args, extra: list[str]) -> int:
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"error: unknown layout {unknown[0]!r}; known: {', '.join(LAYOUTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    expected = estimates(names, args.nproc, args.global_batch, extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", *sys.argv[1:]]
    log = out / "worker.log"
    start = time.perf_counter()
    with log.open("w") as f:
        # A session of its own, so that a timeout ends torchrun's workers too.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        print(f"error: the torchrun workers failed: {_error_line(log.read_text(), proc.returncode)} (see {log})",
              file=sys.stderr)
        return 1
    measured = json.loads((out / "worker.json").read_text())
    rows = [summarize(name, measured[name], expected[name]) for name in names]
    base = rows[0]["step_s"]
    for row in rows:
        row["step_ratio"] = row["step_s"] / base
    seq = expected[names[0]]["report"]["layout"]["seq_len"]
    header = (f"Layouts of the debug model on {args.nproc} gloo ranks, global batch {args.global_batch} x seq {seq}"
              f"{(' with ' + ' '.join(extra)) if extra else ''}: comm bytes of rank 0 in one step, step "
              f"time median of {args.rounds} interleaved rounds x {args.steps} steps relative to {names[0]} "
              f"(wall {time.perf_counter() - start:.0f}s).")
    (out / "results.json").write_text(json.dumps({"header": header, "layouts": rows}, indent=1))
    md = markdown(rows)
    (out / "results.md").write_text(f"{header}\n\n{md}\n")
    bar_plot(rows, out / "results.png", header)
    print(header, md, f"wrote {out}/results.md, results.json, results.png", sep="\n\n")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated; known: {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--nproc", type=int, default=4, help="world size")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, the same for every layout")
    parser.add_argument("--out", default="/tmp/bench_titan_comm", help="output folder")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before the workers count as failed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args(argv)
    if args.worker:
        code = 1
        try:
            worker(args, extra)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            shutdown()
            sys.stdout.flush()
            os._exit(code)
    return launch(args, extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
