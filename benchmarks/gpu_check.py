"""Every GPU claim of the suite measured in one run: `benchmarks/gpu_check.sh OUT_DIR [--part NAME] [--dry-run]`.

Parts, each through the suite's own entry points (titan.compare, titan.train, benchmarks/titan_checkpoint.py,
lcsm.bench, morphens.run, pytest), each under a time budget so that the whole run fits 9 minutes on one H200:
- titan: Llama 3.1 8B width (4 layers, 128K vocabulary, seq 8192, bf16) for bf16, +compile, float8 tensorwise
  through titan's Float8Linear and through torchao's, each eager and compiled, +float8_rowwise (torchao's where
  installed), +selective_ac: tokens/s, MFU against the device's dense bf16
  peak (989 TFLOP/s on an H200) and against a bf16 matmul peak measured in this run, peak memory, loss; a
  profiled run's trace and memory snapshot; how long an async DCP save blocks the loop vs a sync one.
- lcsm: the mixer and end-to-end generation, flash (hybrid, fft, triton tau) vs lazy and eager, L = 2^14 and up
  while the budget lasts, with every method's error against the FFT reference.
- morphens: K = 8 MotherNets vs 8 independent trainings on scikit-learn's digits, nets and batches on the GPU:
  wall time, FLOPs, accuracy, the device each record ran on.
- tests: benchmarks/gpu_numerics.py (float8 `_scaled_mm` vs emulation and bf16, compiled vs eager) on the device.
Files under OUT_DIR (8 at most; a rerun of one part rewrites its own files and the summary): summary.md, log.txt,
titan.json, titan_trace.json.gz, titan_memory_snapshot.pickle.gz (titan_memory_ops.txt on a CPU, which has no
allocator history), lcsm.json, morphens.json, tests.txt. `--dry-run` runs every part on the CPU with tiny shapes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan.components.metrics.throughput import gpu_peak_tflops, measure_matmul_peak_tflops

PARTS = ("titan", "lcsm", "morphens", "tests")
BUDGET_S = {"titan": 330, "lcsm": 70, "morphens": 70, "tests": 40}
"""Seconds per part on the GPU: 510 of the 540 the run may take, the rest for start-up and the matmul peak."""
DRY_BUDGET_S = {"titan": 400, "lcsm": 120, "morphens": 150, "tests": 150}
"""Caps, not targets: about a minute in all on a quiet 2-core box, several on a loaded one."""
RECIPES = ("baseline,+compile,+float8_titan,+compile+float8_titan,+float8_torchao,+compile+float8_torchao,"
           "+float8_rowwise,+selective_ac")
PAPER = {"mixer_speedup": 110.0, "e2e_speedup": 7.8,
         "source": "Oncescu et al., Flash Inference (2024): up to 110x on the mixer, 7.8x end to end, on a GPU"}
LOG_TAIL_BYTES = 400_000  # per command, so log.txt stays far under the 16 MiB a returned file may have


@dataclass
class Check:
    out: Path
    work: Path
    dry: bool
    device: torch.device
    env: dict = field(default_factory=lambda: dict(os.environ, PYTHONUNBUFFERED="1"))

    def run(self, cmd: list[str], deadline: float, env: dict | None = None) -> tuple[int, float]:
        """Runs a command until it ends or the part's deadline passes; its output goes to log.txt."""
        timeout = max(1.0, deadline - time.monotonic())
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})})
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = 124, f"{_text(e.stdout)}{_text(e.stderr)}\n[timed out after {timeout:.0f} s]"
        elapsed = time.monotonic() - start
        with (self.out / "log.txt").open("a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n[exit {rc} after {elapsed:.1f} s]\n{output[-LOG_TAIL_BYTES:]}\n")
        print(f"  exit {rc} after {elapsed:.1f} s: {' '.join(cmd[:4])} ...", flush=True)
        return rc, elapsed


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _gzip_to(src: Path | None, dst: Path) -> str | None:
    if src is None:
        return None
    with src.open("rb") as f, gzip.open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
    return dst.name


def titan_args(c: Check) -> list[str]:
    if c.dry:
        # The debug model, one block, short sequences; fp32 (a CPU without bf16 units runs bf16 matmuls ~50x
        # slower than fp32) and compile's graph capture (dynamo, the eager backend) without AOT autograd or
        # inductor's code generation: the same code paths of the harness in seconds (aot_eager cost 11 s more;
        # tests/titan/compare runs the real inductor). The float8 recipes still quantize (emulated).
        return ["--config", "configs/titan/debug.toml", "--model.n_layers", "1", "--training.seq_len", "64",
                "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1",
                "--training.mixed_precision_param", "float32", "--compile.backend", "eager"]
    return ["--config", "configs/titan/llama3_8b.toml", "--model.n_layers", "4", "--activation_checkpoint.mode",
            "none", "--training.local_batch_size", "1", "--training.seq_len", "8192", "--lr_scheduler.warmup_steps",
            "5"]


def titan_recipes(c: Check, base: list[str], peak: float, deadline: float) -> list[dict]:
    steps, warmup, timeout = ("2", "1", "120") if c.dry else ("15", "5", "100")
    folder = c.work / "compare"
    c.run([sys.executable, "-m", "titan.compare", "--recipes", RECIPES, "--steps", steps, "--warmup", warmup,
           "--rounds", "1", "--timeout", timeout, "--out", str(folder), *base], deadline)
    rows = (_json(folder / "results.json") or {}).get("recipes", [])
    for row in rows:
        row["mfu_of_measured_peak"] = 100 * row["tflops"] / peak if row.get("tflops") else None
    return rows


def titan_profile(c: Check, base: list[str], deadline: float) -> dict:
    """A short profiled run: a chrome trace and the memory record of its last step, gzipped into OUT."""
    folder = c.work / "profile"
    steps = "2" if c.dry else "4"
    rc, _ = c.run([sys.executable, "-m", "titan.train", *base, "--training.steps", steps,
                   "--profiling.enable_profiling", "true", "--profiling.enable_memory_snapshot", "true",
                   "--profiling.profile_freq", steps,
                   "--job.dump_folder", str(folder), "--checkpoint.enable", "false", "--validation.enable", "false",
                   "--metrics.enable_tensorboard", "false"], deadline)
    first = lambda pattern: next(iter(sorted(folder.glob(pattern))), None)  # noqa: E731
    files = {"trace": _gzip_to(first("profile_traces/iteration_*/rank0_trace.json"), c.out / "titan_trace.json.gz")}
    snapshot = first("memory_snapshot/iteration_*/rank0_memory_snapshot.pickle")
    ops = first("memory_snapshot/iteration_*/rank0_memory_ops.txt")
    if snapshot:
        files["memory"] = _gzip_to(snapshot, c.out / "titan_memory_snapshot.pickle.gz")
    elif ops:
        shutil.copyfile(ops, c.out / "titan_memory_ops.txt")
        files["memory"] = "titan_memory_ops.txt"
    return {"exit_code": rc, "files": files}


def titan_checkpoint(c: Check, deadline: float) -> dict:
    # The dry run saves at every step of 2 (2 saves per run, as its 4 steps at interval 2 gave, in half the steps).
    size = ["--dim", "64", "--n_layers", "1", "--steps", "2", "--interval", "1"] if c.dry else [
        "--dim", "2048", "--n_layers", "4", "--steps", "6", "--interval", "2"]
    folder = c.work / "checkpoint"
    rc, _ = c.run([sys.executable, "benchmarks/titan_checkpoint.py", *size, "--out", str(folder)], deadline)
    return {"exit_code": rc, **(_json(folder / "results.json") or {})}


def part_titan(c: Check, deadline: float) -> None:
    sizes = (128, 256, 512) if c.dry else (4096, 8192, 16384)
    # The peak in the dtype the recipes compute in: the dry run trains in fp32, and against an (emulated) bf16
    # peak its MFU came out above 150%.
    dtype = torch.float32 if c.dry else torch.bfloat16
    rates = measure_matmul_peak_tflops(c.device, sizes, repeats=2 if c.dry else 10, dtype=dtype)
    peak = max(rates.values())
    base = titan_args(c) + (["--metrics.cpu_peak_tflops", f"{peak:.6f}"] if c.device.type == "cpu" else [])
    table_peak = gpu_peak_tflops(torch.cuda.get_device_name()) if c.device.type == "cuda" else None
    result = {"device": device_name(c.device), "base_overrides": base, "matmul_peak_tflops": rates,
              "measured_peak_tflops": peak, "peak_dtype": str(dtype)[6:], "table_peak_tflops": table_peak}
    # The table is written only when every recipe ran: it must end in time for the profile and the checkpoint
    # runs after it (its own per-run timeout keeps a hung recipe from taking the rest).
    result["recipes"] = titan_recipes(c, base, peak, deadline - (0 if c.dry else 80))
    result["profile"] = titan_profile(c, base, deadline)
    result["checkpoint"] = titan_checkpoint(c, deadline)
    (c.out / "titan.json").write_text(json.dumps(result, indent=1))


def lcsm_lengths(c: Check) -> list[int]:
    return [64, 128] if c.dry else [2**k for k in range(14, 21)]


def part_lcsm(c: Check, deadline: float) -> None:
    """One lcsm.bench process per length, longer ones while the budget lasts (each about 2-4x the last)."""
    from lcsm.inference.tau import triton_available

    methods = ["lazy", "eager", "flash", "flash_fft"] + (["flash_triton"] if triton_available(c.device) else [])
    # Eager decode: compiling it (a minute, once per shape) does not fit the part's budget.
    size = ["--channels", "8", "--layers", "1", "--budget", "2"] if c.dry else ["--budget", "15"]
    size += ["--decode", "eager"]
    e2e_max = 128 if c.dry else 2**16
    # On the GPU one process per length, so that the budget decides after each whether the next fits; the dry
    # run's lengths all go to one process (a second one only paid the start-up again: ~5 s on 2 cores).
    batches = [[L] for L in lcsm_lengths(c)] if not c.dry else [lcsm_lengths(c)]
    records, last = [], 0.0
    for lengths in batches:
        if records and not c.dry and 3 * last > deadline - time.monotonic():
            break
        folder = c.work / f"lcsm-{'-'.join(map(str, lengths))}"
        parts = ["mixer", "e2e"] if min(lengths) <= e2e_max else ["mixer"]
        rc, last = c.run([sys.executable, "-m", "lcsm.bench", "--lengths", *map(str, lengths), "--methods", *methods,
                          "--parts", *parts, "--e2e-max-len", str(e2e_max), "--device", c.device.type, *size,
                          "--out", str(folder)], deadline)
        records += _json(folder / "results.json") or []
    (c.out / "lcsm.json").write_text(json.dumps({"device": device_name(c.device), "paper": PAPER,
                                                 "speedups": lcsm_speedups(records), "records": records}, indent=1))


def lcsm_speedups(records: list[dict]) -> list[dict]:
    """Per part and length: the fastest flash variant's total time against lazy's and eager's."""
    rows = []
    for part, L in sorted({(r["part"], r["seq_len"]) for r in records}):
        at = {r["method"]: r for r in records if r["part"] == part and r["seq_len"] == L}
        flash = min((r for m, r in at.items() if m.startswith("flash")), key=lambda r: r["total_s"], default=None)
        if flash is None:
            continue
        row = {"part": part, "seq_len": L, "best_flash": flash["method"], "flash_s": flash["total_s"],
               "max_abs_err": max(r["max_abs_err"] for r in at.values())}
        for base in ("lazy", "eager"):
            row[f"vs_{base}"] = at[base]["total_s"] / flash["total_s"] if base in at else None
        rows.append(row)
    return rows


def part_morphens(c: Check, deadline: float) -> None:
    folder = c.work / "morphens"
    # One batch (128 images) per epoch: every net still trains, the mother hatches its 8 members.
    quick = ["--data.train_limit", "128", "--data.test_limit", "100", "--training.epochs", "1",
             "--mothernet.mother_epochs", "1", "--mothernet.hatch_epochs", "1"] if c.dry else [
        # All of digits' 1,437 training images, epochs cut so that both ensembles train within the budget.
        "--training.epochs", "3", "--mothernet.mother_epochs", "6", "--mothernet.hatch_epochs", "1"]
    threads = str(min(8, os.cpu_count() or 1))
    rc, _ = c.run([sys.executable, "-m", "morphens.run", "--data.dataset", "digits", "--ensemble.size", "8",
                   "--training.threads", threads, *quick, "--run.out", str(folder)], deadline)
    results = (_json(folder / "results.json") or {}).get("results")
    # Nets and batches live on training.device (default: the GPU where there is one); each record names it.
    devices = sorted({r["device"] for r in results or []})
    (c.out / "morphens.json").write_text(json.dumps({"exit_code": rc, "device": ",".join(devices) or None,
                                                     "threads": threads, "results": results}, indent=1))


def part_tests(c: Check, deadline: float) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "benchmarks/gpu_numerics.py"]
    timeout = max(1.0, deadline - time.monotonic())
    env = {**c.env, "TITAN_TEST_DEVICE": c.device.type}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text = f"exit {proc.returncode}\n{proc.stdout}{proc.stderr[-LOG_TAIL_BYTES:]}"
    except subprocess.TimeoutExpired as e:
        text = f"exit 124 (timed out after {timeout:.0f} s)\n{_text(e.stdout)}"
    (c.out / "tests.txt").write_text(text)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}"


PART_FUNCTIONS = {"titan": part_titan, "lcsm": part_lcsm, "morphens": part_morphens, "tests": part_tests}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_check.sh", description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="outputs/gpu_check", help="folder for the result files")
    p.add_argument("--part", choices=PARTS, action="append", help="run this part only (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="every part on the CPU, tiny shapes")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: benchmarks/gpu_check.sh needs a CUDA GPU and torch sees none; --dry-run runs it on the CPU",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    budgets = DRY_BUDGET_S if args.dry_run else BUDGET_S
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        check = Check(out, Path(work), args.dry_run, device)
        (out / "log.txt").write_text(f"gpu_check on {device_name(device)}, load {os.getloadavg()}\n")
        for part in args.part or PARTS:
            print(f"{part}: up to {budgets[part]} s", flush=True)
            PART_FUNCTIONS[part](check, time.monotonic() + budgets[part])
    from gpu_check_summary import write_summary

    print(write_summary(out, device_name(device), os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
