"""`python -m lcsm.bench`: online long convolution, flash vs the lazy/eager/recompute baselines, in one run.

Two parts, each timing autoregressive steps after a one-token prompt:
- mixer: one long convolution (D channels, batch B) fed random inputs, the engine alone;
- e2e:   a Hyena LM with random weights (layers x order long convolutions, MLPs, head) fed fixed random tokens.
Quadratic methods are skipped at lengths where their predicted time exceeds --budget seconds.
On the CPU, times are the process's CPU time (one thread by default): on a shared machine other jobs then do not
distort the ratios, and on an idle one it equals the wall time, which each record also keeps (wall_s).
Writes DIR/results.json (one record per method and length) and DIR/results.png (time per token vs L).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from lcsm.engines import build_engine
from lcsm.fftconv import fft_causal_conv
from lcsm.model import HyenaArgs, HyenaLM
from lcsm.tau import TAUS, triton_available
from titan.tools.cli import UserError, entry_point, run

QUADRATIC = {"lazy", "eager", "recompute", "flash_direct", "flash_conv1d", "flash_triton"}
"""Budgeted methods: quadratic in L, or (the direct taus) quadratic in the largest tile."""
E2E_METHODS = ["lazy", "eager", "flash", "flash_unbatched"]


def method_options(method: str) -> tuple[str, dict]:
    """'flash' is flash with the hybrid tau; 'flash_<tau>' picks the tau; 'flash_unbatched' calls tau per layer."""
    if method in ("lazy", "eager", "recompute"):
        return method, {}
    if method == "flash":
        return "flash", {"tau": "hybrid"}
    if method == "flash_unbatched":
        return "flash", {"tau": "hybrid", "batch_layers": False}
    if method.startswith("flash_") and method[6:] in TAUS:
        return "flash", {"tau": method[6:]}
    raise ValueError(f"unknown method {method!r}")


def all_methods(device: torch.device) -> list[str]:
    taus = ["fft", "direct", "conv1d"] + (["triton"] if device.type == "cuda" and triton_available(device) else [])
    return ["lazy", "eager", "recompute", "flash", "flash_unbatched"] + [f"flash_{t}" for t in taus]


def clock(device: torch.device):
    return time.perf_counter if device.type == "cuda" else time.process_time


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_mixer(method: str, L: int, D: int, B: int, device: torch.device, budget: float, seed: int = 0) -> dict | None:
    gen = torch.Generator().manual_seed(seed)
    rho = (torch.randn(1, D, L, generator=gen) * torch.exp(-torch.arange(L) / (L / 4))).to(device)
    y_LBD = torch.randn(L, B, D, generator=gen).to(device)
    name, options = method_options(method)
    if name == "flash":  # fill hybrid's autotune cache outside the timing
        _run_mixer(build_engine(name, rho, B, **options), y_LBD, device, budget)
    wall_start = time.perf_counter()
    result = _run_mixer(build_engine(name, rho, B, **options), y_LBD, device, budget)
    if result is None:
        return None
    z_LBD, seconds = result
    wall_s = time.perf_counter() - wall_start
    ref = fft_causal_conv(y_LBD.permute(1, 2, 0).double(), rho[0].double()).permute(2, 0, 1)
    err = (z_LBD.double() - ref).abs().max().item()
    return dict(mixer_s=seconds, total_s=seconds, wall_s=wall_s, max_abs_err=err, layers=1)


def _run_mixer(engine, y_LBD: torch.Tensor, device: torch.device, budget: float) -> tuple[torch.Tensor, float] | None:
    """Outputs and seconds of the steps after a one-token prefill; None once over budget."""
    z = torch.empty_like(y_LBD)
    z[0:1] = engine.prefill(y_LBD[0:1].permute(1, 2, 0)).permute(2, 0, 1)
    now = clock(device)
    sync(device)
    start = now()
    for t in range(1, y_LBD.shape[0]):
        z[t] = engine.step(y_LBD[t])
        if t % 1024 == 0 and now() - start > budget:
            return None
    sync(device)
    return z, now() - start


def e2e_args(L: int, D: int, layers: int) -> HyenaArgs:
    return HyenaArgs(dim=D, n_layers=layers, vocab_size=512, max_seq_len=L)


def bench_e2e(method: str, L: int, D: int, B: int, layers: int, device: torch.device, budget: float,
              cache: dict) -> dict | None:
    key = (L, D, B, layers)
    if key not in cache:  # one model, token stream and parallel reference per shape, shared by all methods
        torch.manual_seed(0)
        model = HyenaLM(e2e_args(L, D, layers)).to(device)
        model.init_weights()
        tokens = torch.randint(0, 512, (B, L), device=device)
        with torch.no_grad():
            last_logits = model(tokens)[:, -1]
        cache.clear()
        cache[key] = (model, tokens, last_logits)
    model, tokens, ref = cache[key]
    name, options = method_options(method)
    if name == "flash":  # fill hybrid's autotune cache outside the timing, with the engine alone
        rho = model.inference_filters()
        _run_mixer_slots(build_engine(name, rho, B, **options), torch.randn(L, B, rho.shape[1], device=device))
    state = model.new_decode_state(name, B, **options)
    mixer_s = [0.0]
    engine_step = state.engine.step

    now = clock(device)

    def timed_step(y, slot):
        sync(device)
        start = now()
        z = engine_step(y, slot)
        sync(device)
        mixer_s[0] += now() - start
        return z

    state.engine.step = timed_step
    model.prefill(tokens[:, :1], state)
    sync(device)
    start, wall_start = now(), time.perf_counter()
    for t in range(1, L):
        logits = model.step(tokens[:, t], state)
        if t % 256 == 0 and now() - start > budget:
            return None
    sync(device)
    total_s = now() - start
    return dict(mixer_s=mixer_s[0], total_s=total_s, wall_s=time.perf_counter() - wall_start,
                max_abs_err=(logits - ref).abs().max().item(), layers=layers)


def _run_mixer_slots(engine, y_LBD: torch.Tensor) -> None:
    for g in range(engine.G):
        engine.prefill(y_LBD[0:1].permute(1, 2, 0), g)
    for t in range(1, y_LBD.shape[0]):
        for g in range(engine.G):
            engine.step(y_LBD[t], g)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = sorted({r["part"] for r in records})
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        for method in dict.fromkeys(r["method"] for r in records if r["part"] == part):
            rows = [r for r in records if r["part"] == part and r["method"] == method]
            ax.loglog([r["seq_len"] for r in rows], [r["us_per_token"] for r in rows], "o-", label=method)
        ax.set(title=f"{part}: time per generated token", xlabel="sequence length L", ylabel="µs / token")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratio_summary(records: list[dict]) -> list[str]:
    """flash vs lazy per part and length, and flash with tau batched over layers vs one tau call per layer."""
    def find(part, method, L):
        return next((r for r in records if (r["part"], r["method"], r["seq_len"]) == (part, method, L)), None)

    lines = []
    for part, L in dict.fromkeys((r["part"], r["seq_len"]) for r in records):
        flash, lazy, unbatched = find(part, "flash", L), find(part, "lazy", L), find(part, "flash_unbatched", L)
        if flash and lazy:
            lines.append(f"{part} L={L}: flash {lazy['total_s'] / flash['total_s']:.1f}x faster than lazy"
                         + (f" (mixer {lazy['mixer_s'] / flash['mixer_s']:.1f}x)" if part == "e2e" else ""))
        if flash and unbatched:
            lines.append(f"{part} L={L}: tau batched over layers {unbatched['mixer_s'] / flash['mixer_s']:.2f}x "
                         "faster (mixer time) than per-layer tau calls")
    return lines


def print_table(records: list[dict]) -> None:
    print(f"{'part':6} {'method':16} {'L':>7} {'mixer_s':>9} {'total_s':>9} {'us/tok':>9} {'vs lazy':>8} {'err':>9}")
    for r in records:
        lazy = next((x for x in records if x["part"] == r["part"] and x["method"] == "lazy"
                     and x["seq_len"] == r["seq_len"]), None)
        ratio = f"{lazy['total_s'] / r['total_s']:8.1f}" if lazy else f"{'-':>8}"
        print(f"{r['part']:6} {r['method']:16} {r['seq_len']:7d} {r['mixer_s']:9.3f} {r['total_s']:9.3f} "
              f"{r['us_per_token']:9.1f} {ratio} {r['max_abs_err']:9.1e}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lcsm.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small lengths, e2e at 256 only (< 30 s)")
    p.add_argument("--out", default="outputs/lcsm_bench", help="folder for results.json and results.png")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 2^10 .. 2^17)")
    p.add_argument("--methods", nargs="+", help="methods (default all): lazy eager recompute flash flash_unbatched "
                   "flash_<tau>")
    p.add_argument("--parts", nargs="+", default=["mixer", "e2e"], help="mixer and/or e2e")
    p.add_argument("--e2e-max-len", type=int, help="longest e2e length (default 2^14, quick 2^8)")
    p.add_argument("--channels", type=int, default=64, help="mixer channels D (also the e2e model width)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4, help="e2e model layers (x order 2 long convolutions)")
    p.add_argument("--budget", type=float, help="seconds a quadratic method may take at one length (default 60, "
                   "quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny FFTs slow down with more on a "
                   "loaded box)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a torch device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: the benchmark runs on cpu or cuda")
    return device


@entry_point
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = check_device(args.device)
    out = Path(args.out)
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UserError(f"--out {args.out} cannot be written ({probe} is not a writable folder); give another folder")
    lengths = args.lengths or ([2**8, 2**10, 2**12] if args.quick else [2**k for k in range(10, 18)])
    budget = args.budget if args.budget is not None else (3.0 if args.quick else 60.0)
    e2e_max_len = args.e2e_max_len or (2**8 if args.quick else 2**14)
    methods = args.methods or all_methods(device)
    errors = []
    if min(lengths) < 2:
        errors.append(f"--lengths must be >= 2, got {min(lengths)}")
    for m in methods:
        try:
            method_options(m)
        except ValueError as e:
            errors.append(f"{e}; choose from {' '.join(all_methods(device))}")
    if set(args.parts) - {"mixer", "e2e"}:
        errors.append(f"--parts must be mixer and/or e2e, got {' '.join(args.parts)}")
    if min(args.channels, args.batch, args.layers, args.threads) < 1:
        errors.append("--channels, --batch, --layers and --threads must be >= 1")
    if "flash_triton" in methods and not triton_available(device):
        errors.append("flash_triton needs Triton and a CUDA device; drop it from --methods")
    if errors:
        raise UserError(errors[0])
    torch.set_num_threads(args.threads)
    timing = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"lcsm.bench on {device} ({timing}), {torch.get_num_threads()} thread(s), float32, D={args.channels}, "
          f"B={args.batch}, e2e layers={args.layers} (order 2), budget {budget:.0f} s per quadratic run")
    records: list[dict] = []
    e2e_cache: dict = {}
    for part in args.parts:
        predicted_over: set[str] = set()
        for L in sorted(lengths):
            if part == "e2e" and L > e2e_max_len:
                continue
            for method in methods:
                if part == "mixer" and method == "flash_unbatched":
                    continue  # one layer: the same as flash
                if method in predicted_over or (part == "e2e" and not args.methods and method not in E2E_METHODS):
                    continue
                limit = budget if method in QUADRATIC else float("inf")
                try:
                    if part == "mixer":
                        rec = bench_mixer(method, L, args.channels, args.batch, device, limit)
                    else:
                        rec = bench_e2e(method, L, args.channels, args.batch, args.layers, device, limit, e2e_cache)
                except MemoryError as e:
                    print(f"  {part} {method}: skipped from L={L} ({e})")
                    predicted_over.add(method)
                    continue
                if rec is None:
                    predicted_over.add(method)
                    print(f"  {part} {method}: stopped at L={L} after the {budget:.0f} s budget; skipped from here")
                    continue
                rec = dict(part=part, method=method, seq_len=L, batch=args.batch, channels=args.channels,
                           threads=torch.get_num_threads(), device=str(device), **rec)
                rec["us_per_token"] = rec["total_s"] / (L - 1) * 1e6
                records.append(rec)
                print(f"  {part} {method} L={L}: {rec['total_s']:.3f} s, err {rec['max_abs_err']:.1e}", flush=True)
                next_L = min((x for x in lengths if x > L), default=None)
                if method in QUADRATIC and next_L and rec["total_s"] * (next_L / L) ** 2 > budget:
                    predicted_over.add(method)
                    print(f"  {part} {method}: skipped from L={next_L} (predicted over the {budget:.0f} s budget)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    plot(records, out / "results.png")
    print_table(records)
    print("\n".join(ratio_summary(records)))
    print(f"wrote {out / 'results.json'} and {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    run(main)
