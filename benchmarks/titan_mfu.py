"""MFU of a titan config on this machine, against the matmul peak measured in the same run, and where the step's
time goes per op class (attention, matmuls, norms, loss, optimizer, copies, elementwise, other).

    python benchmarks/titan_mfu.py [--config configs/titan/llama3_100m.toml] [--steps 3]
        [--variant NAME="--section.key value ..."] ... [--out outputs/bench_titan_mfu]

Each variant is the config with its overrides (the first, `base`, has none unless given); the variants' steps run
interleaved, round by round, so load from other jobs hits them alike; the table shows each variant's median wall
seconds per step and median process CPU seconds (all threads: what load inflates least). The first step of each
is a warm-up (and compiles); one more step per variant runs under torch.profiler for the breakdown (self time of
each op, on the host's threads: the CPU's time, or on CUDA the time to queue). The peak is the best square-matmul
rate in the run's compute dtype, measured before, between and after the rounds, at each thread count a variant
uses (`--debug.threads`): MFU divides by the peak of the variant's own thread count. The record names the CPU's
bf16 units (AMX, AVX512-BF16) that oneDNN had to run on.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from titan.components.metrics.throughput import measure_matmul_peak_tflops
from titan.config import parse_args
from titan.config.dtypes import TORCH_DTYPES
from titan.tools.logging import init_logger
from titan.trainer import Trainer

# Op classes by op name fragment, first match wins; ops under the optimizer's step count as optimizer whatever
# their names. Fused kernels of torch.compile show as the self time of the compiled region.
CLASSES = [
    ("compiled", ("CompiledFxGraph", "CompiledFunction", "Torch-Compiled Region", "cpp_fused", "triton_")),
    ("optimizer", ("_foreach_", "_fused_adam", "_fused_sgd", "linalg_vector_norm")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "_softmax_backward")),
    ("norms", ("rms_norm", "layer_norm")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_scaled_mm",
                 "aten::baddbmm")),
    ("copies", ("copy_", "aten::to", "_to_copy", "clone", "contiguous", "aten::cat", "aten::stack",
                "repeat_interleave", "index_select", "aten::embedding", "aten::fill_", "aten::zero_", "aten::empty")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu", "aten::neg", "aten::pow",
                     "aten::rsqrt", "aten::mean", "aten::sum", "aten::where", "aten::sigmoid", "threshold",
                     "aten::exp", "aten::sqrt", "aten::clamp")),
]
OPTIMIZER_SCOPES = ("Optimizer.step", "Optimizer.zero_grad")


def op_class(name: str, scopes: list[str]) -> str:
    if any(s.startswith(OPTIMIZER_SCOPES) for s in scopes):
        return "optimizer"
    for cls, fragments in CLASSES:
        if any(f in name for f in fragments):
            return cls
    return "other"


def breakdown(prof: profile) -> dict[str, float]:
    """Seconds of self time per op class over the profiled step."""
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.self_cpu_time_total <= 0:
            continue
        scopes, parent = [], event.cpu_parent
        while parent is not None:
            scopes.append(parent.name)
            parent = parent.cpu_parent
        seconds[op_class(event.name, scopes)] += event.self_cpu_time_total / 1e6
    return dict(seconds)


class Contender:
    def __init__(self, name: str, config_args: list[str]):
        self.name = name
        self.config = parse_args(config_args)
        self.trainer = Trainer(self.config)
        self.data = iter(self.trainer.dataloader)
        self.tokens_per_step = self.trainer.global_batch_size * self.config.training.seq_len
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []  # the process's CPU seconds per step (all threads): what load does not inflate
        self.peak_key = (self.trainer.threads, self.config.training.mixed_precision_param)

    def step(self) -> tuple[float, float]:
        """One training step: (wall seconds, process CPU seconds)."""
        torch.set_num_threads(self.trainer.threads)  # the process-wide count: each variant runs at its own
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.trainer.train_step(self.data)
        self.trainer.step += 1
        self.trainer.read_step(out)  # waits for the device
        return time.perf_counter() - t0, time.process_time() - c0

    def profiled_step(self, top: int) -> dict[str, float]:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=top > 0) as prof:
            self.step()
        if top:
            print(f"{self.name}: top {top} ops by self time")
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=top,
                                                                     max_name_column_width=60))
        return breakdown(prof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/titan/llama3_100m.toml")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant, after one warm-up step")
    parser.add_argument("--variant", action="append", default=[], metavar='NAME="OVERRIDES"',
                        help="a variant: a name and config overrides (repeatable); default: base")
    parser.add_argument("--out", default="outputs/bench_titan_mfu")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--top", type=int, default=0, help="also print the N ops with the most self time")
    args, common = parser.parse_known_args()
    variants = [v.split("=", 1) if "=" in v else (v, "") for v in args.variant] or [("base", "")]
    init_logger()
    out = Path(args.out)
    base_args = ["--config", args.config, *common, "--training.steps", str(args.steps + 2),
                 "--validation.enable", "false", "--checkpoint.enable", "false", "--metrics.enable_jsonl", "false",
                 "--metrics.enable_tensorboard", "false", "--metrics.cpu_peak_tflops", "1"]
    contenders = [Contender(name, [*base_args, "--job.dump_folder", str(out / name), *shlex.split(overrides)])
                  for name, overrides in variants]
    device = contenders[0].trainer.device
    # AMX reaches its peak between n = 1024 and 4096; the time budget stops a slower CPU sooner.
    sizes = (1024, 2048, 3072, 4096) if device.type == "cpu" else (4096, 8192)
    # Peaks per (threads, compute dtype) that a variant runs at; a variant's MFU divides by its own.
    peaks: dict[tuple[int, str], list[float]] = {c.peak_key: [] for c in contenders}

    def measure_peaks() -> None:
        for (threads, dtype), measured in peaks.items():
            torch.set_num_threads(threads)
            measured.append(max(measure_matmul_peak_tflops(device, sizes, budget_s=4.0,
                                                           dtype=TORCH_DTYPES[dtype]).values()))

    measure_peaks()
    for c in contenders:
        c.step()  # warm-up (and compile)
    for _ in range(args.steps):
        for c in contenders:
            wall_s, cpu_s = c.step()
            c.step_s.append(wall_s)
            c.cpu_s.append(cpu_s)
        measure_peaks()
    profiles = {} if args.no_profile else {c.name: c.profiled_step(args.top) for c in contenders}
    best_peak = {key: max(measured) for key, measured in peaks.items()}
    results = []
    for c in contenders:
        step_s = sorted(c.step_s)[len(c.step_s) // 2]
        cpu_s = sorted(c.cpu_s)[len(c.cpu_s) // 2]
        tflops = c.trainer.flops_per_token * c.tokens_per_step / step_s / 1e12
        results.append({"variant": c.name, "overrides": dict(variants)[c.name], "threads": c.peak_key[0],
                        "dtype": c.peak_key[1], "step_s_median": step_s, "step_s": c.step_s,
                        "cpu_s_median": cpu_s, "cpu_s": c.cpu_s,
                        "tokens_per_step": c.tokens_per_step,
                        "tps": c.tokens_per_step / step_s, "tflops": tflops,
                        "mfu": 100 * tflops / best_peak[c.peak_key], "breakdown_s": profiles.get(c.name, {})})
        c.trainer.close()
    # Which bf16 units the peak and the matmuls ran on (oneDNN picks AMX tiles where the CPU has them).
    cpu = {"capability": torch.backends.cpu.get_cpu_capability(), "amx": torch.cpu._is_amx_tile_supported(),
           "avx512_bf16": torch.cpu._is_avx512_bf16_supported()} if device.type == "cpu" else None
    record = {"config": args.config, "device": str(device), "cpu": cpu,
              "peaks_tflops": [{"threads": t, "dtype": d, "best": best_peak[t, d], "measured": m}
                               for (t, d), m in peaks.items()],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    if cpu:
        print(f"cpu: {cpu['capability']}, AMX {cpu['amx']}, AVX512-BF16 {cpu['avx512_bf16']}")
    for (threads, dtype), measured in peaks.items():
        print(f"{args.config} on {device}, {threads} threads: {dtype} matmul peak {best_peak[threads, dtype]:.3f} "
              f"TFLOP/s (best of {', '.join(f'{p:.3f}' for p in measured)})")
    classes = sorted({k for r in results for k in r["breakdown_s"]}, key=lambda k: -results[0]["breakdown_s"].get(k, 0))
    header = "".join(f"{k:>12}" for k in classes)
    print(f"{'variant':<16}{'s/step':>8}{'cpu s':>7}{'tok/s':>8}{'TFLOP/s':>9}{'MFU %':>7}  {header}")
    for r in results:
        total = sum(r["breakdown_s"].values()) or 1.0
        shares = "".join(f"{100 * r['breakdown_s'].get(k, 0) / total:>11.1f}%" for k in classes)
        print(f"{r['variant']:<16}{r['step_s_median']:>8.2f}{r['cpu_s_median']:>7.2f}{r['tps']:>8.0f}"
              f"{r['tflops']:>9.3f}{r['mfu']:>7.1f}  " + shares)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
