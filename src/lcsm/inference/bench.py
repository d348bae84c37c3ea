"""`python -m lcsm.bench`: online long convolution, flash vs the lazy/eager/recompute baselines, in one run.

Two parts, each timing autoregressive steps after a one-token prompt:
- mixer: one long convolution (D channels, batch B) fed random inputs, the engine alone;
- e2e:   a Hyena LM with random weights (layers x order long convolutions, MLPs, head) fed fixed random tokens.
Quadratic methods are skipped at lengths where their predicted time exceeds --budget seconds.
--model hyenadna-<name>: e2e only, a HyenaDNA of that published configuration with random weights, flash vs lazy;
lazy beyond its budget is extrapolated from its measured time per token (linear in L) and marked as such.
On the CPU, times are the process's CPU time (one thread by default): on a shared machine other jobs then do not
distort the ratios, and on an idle one it equals the wall time, which each record also keeps (wall_s).
Writes DIR/results.json (one record per method, length and batch) and DIR/results.png (time per token vs L).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lcsm.inference import bench_report
from lcsm.inference.accel import native
from lcsm.inference.decode import DECODES, new_decode_state
from lcsm.inference.engines import build_engine
from lcsm.inference.tau import TAUS, triton_available
from lcsm.model.fftconv import fft_causal_conv
from lcsm.model.hyena import HyenaArgs, HyenaLM
from lcsm.model.hyenadna import HYENADNA_CONFIGS
from titan.tools.cli import UserError, check_writable, entry_point, report_done, run

QUADRATIC = {"lazy", "eager", "recompute", "flash_direct", "flash_conv1d", "flash_triton"}
"""Budgeted methods: quadratic in L, or (the direct taus) quadratic in the largest tile."""
E2E_METHODS = ["lazy", "eager", "flash", "flash_batched", "flash_unbatched"]


def method_options(method: str, block: int | None = None, tensor_steps: bool = False) -> tuple[str, dict]:
    """'flash' is flash with the hybrid tau, its tiles batched over slots where that is faster (timed once);
    'flash_batched' / 'flash_unbatched' always / never batch them; 'flash_<tau>' picks the tau. A block, if given,
    is every flash method's base block size; tensor_steps: lazy's and flash's steps as tensor ops, not in C."""
    steps = {"native_step": False} if tensor_steps else {}
    if method in ("eager", "recompute"):
        return method, {}
    if method == "lazy":
        return method, steps
    name, options = _flash_options(method)
    return name, {**options, **steps, **({"block": block} if block else {})}


def _flash_options(method: str) -> tuple[str, dict]:
    if method == "flash":
        return "flash", {"tau": "hybrid"}
    if method in ("flash_batched", "flash_unbatched"):
        return "flash", {"tau": "hybrid", "batch_layers": method == "flash_batched"}
    if method.startswith("flash_") and method[6:] in TAUS:
        return "flash", {"tau": method[6:]}
    raise ValueError(f"unknown method {method!r}")


def all_methods(device: torch.device) -> list[str]:
    taus = ["fft", "direct", "conv1d"] + (["triton"] if device.type == "cuda" and triton_available(device) else [])
    return ["lazy", "eager", "recompute", "flash", "flash_batched", "flash_unbatched"] + [f"flash_{t}" for t in taus]


def clock(device: torch.device):
    return time.perf_counter if device.type == "cuda" else time.process_time


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_mixer(method: str, L: int, D: int, B: int, device: torch.device, budget: float, seed: int = 0,
                block: int | None = None, tensor_steps: bool = False) -> dict | None:
    gen = torch.Generator().manual_seed(seed)
    rho = (torch.randn(1, D, L, generator=gen) * torch.exp(-torch.arange(L) / (L / 4))).to(device)
    y_LBD = torch.randn(L, B, D, generator=gen).to(device)
    name, options = method_options(method, block, tensor_steps)
    if name == "flash":  # fill the autotune caches outside the timing
        _run_mixer(build_engine(name, rho, B, **options), y_LBD, device, budget)
    wall_start = time.perf_counter()
    engine = build_engine(name, rho, B, **options)
    result = _run_mixer(engine, y_LBD, device, budget)
    if result is None:
        return None
    z_LBD, seconds = result
    wall_s = time.perf_counter() - wall_start
    ref = fft_causal_conv(y_LBD.permute(1, 2, 0).double(), rho[0].double()).permute(2, 0, 1)
    err = (z_LBD.double() - ref).abs().max().item()
    return dict(mixer_s=seconds, total_s=seconds, wall_s=wall_s, max_abs_err=err, layers=1, **_plan(engine))


def _plan(engine) -> dict:
    """How an engine ran: its steps in C or as tensor ops; flash's block and, per tile size, its tau and batching."""
    plan = dict(step="C" if getattr(engine, "c_step", None) else "tensor ops", tiles=None)
    if engine.name == "flash":
        plan.update(tiles={str(U): how for U, how in engine.describe().items()}, block=engine.block)
    return plan


@contextlib.contextmanager
def gc_paused():
    """Python's garbage collector off, as timeit has it: a step's outputs pile up as live tensors, and the
    collector's passes over them cost flash about 2 us per step at D = 64 (and lazy the same 2 of its 700)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_mixer(engine, y_LBD: torch.Tensor, device: torch.device, budget: float) -> tuple[torch.Tensor, float] | None:
    """Outputs and seconds of the steps after a one-token prefill; None once over budget. Each step writes into
    its row of one output buffer, as the inputs are rows of one buffer: views made before the clock starts."""
    z_LBD = torch.empty_like(y_LBD)
    z_LBD[0] = engine.prefill(y_LBD[0:1].permute(1, 2, 0)).permute(2, 0, 1)[0]
    inputs, outputs = y_LBD.unbind(0), z_LBD.unbind(0)
    step, now = engine.step, clock(device)
    sync(device)
    with gc_paused():
        start = now()
        for t in range(1, y_LBD.shape[0]):
            step(inputs[t], out=outputs[t])
            if t % 1024 == 0 and now() - start > budget:
                return None
        sync(device)
        return z_LBD, now() - start


def e2e_args(L: int, D: int, layers: int) -> HyenaArgs:
    return HyenaArgs(dim=D, n_layers=layers, vocab_size=512, max_seq_len=L)


def bench_e2e(method: str, L: int, D: int, B: int, layers: int, device: torch.device, budget: float,
              cache: dict, decode: str = "eager", block: int | None = None,
              tensor_steps: bool = False) -> dict | None:
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
    name, options = method_options(method, block, tensor_steps)
    if name == "flash":  # fill the autotune caches outside the timing, with the engine alone
        rho = model.inference_filters()
        _run_mixer_slots(build_engine(name, rho, B, **options), torch.randn(L, B, rho.shape[1], device=device))
    state = new_decode_state(model, name, B, decode=decode, **options)
    timed = _generate(state, tokens, device, budget)
    if timed is None:
        return None
    logits, times = timed
    return dict(**times, decode=decode, max_abs_err=(logits - ref).abs().max().item(), layers=layers,
                **_plan(state.engine))


def _generate(state, tokens_BL: torch.Tensor, device: torch.device, budget: float) -> tuple[torch.Tensor, dict] | None:
    """Steps the decode state through tokens 1 .. L-1 after a one-token prefill: the last logits and the seconds
    (total_s, the process's; wall_s; mixer_s, the long convolutions' share), or None once over budget."""
    mixer_seconds = _time_long_convolutions(state, device)
    state.prefill(tokens_BL[:, :1])
    inputs, now = tokens_BL.T.unbind(0), clock(device)
    sync(device)
    with gc_paused():
        start, wall_start = now(), time.perf_counter()
        for t in range(1, tokens_BL.shape[1]):
            logits = state.step(inputs[t])
            if t % 256 == 0 and now() - start > budget:
                return None
        sync(device)
        total_s, wall_s = now() - start, time.perf_counter() - wall_start
    return logits, dict(mixer_s=total_s * mixer_seconds() / wall_s, total_s=total_s, wall_s=wall_s)


def _time_long_convolutions(state, device: torch.device) -> Callable[[], float]:
    """Wraps the decode state's engine so that the wall time of its long convolutions adds up, and returns how to
    read it. Timed with perf_counter (30 ns; process_time is a 0.5 us syscall, 16 per token); bench_e2e scales it
    to the process time of the whole run: approximate on a loaded box, while total_s stays exact. On CUDA, the
    steps' kernels alone: the queue is drained before and after. Where the whole token is one C call, that call
    times its engine steps itself, and flash's tiles come after it."""
    seconds, clock_, engine = [0.0], time.perf_counter, state.engine

    def timed(fn):
        def on_cpu(*args, **kwargs):
            start = clock_()
            out = fn(*args, **kwargs)
            seconds[0] += clock_() - start
            return out

        def on_cuda(*args, **kwargs):
            torch.cuda.synchronize()
            start = clock_()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            seconds[0] += clock_() - start
            return out

        return on_cuda if device.type == "cuda" else on_cpu

    engine.step = timed(engine.step)
    fused = getattr(state, "c_token", None) is not None
    if fused:
        state.c_token_args.timed = 1
        engine.tiles_after_position = timed(engine.tiles_after_position)
    return lambda: seconds[0] + (state.c_token_args.engine_ns * 1e-9 if fused else 0.0)


def _run_mixer_slots(engine, y_LBD: torch.Tensor) -> None:
    for g in range(engine.G):
        engine.prefill(y_LBD[0:1].permute(1, 2, 0), g)
    for t in range(1, y_LBD.shape[0]):
        for g in range(engine.G):
            engine.step(y_LBD[t], g)


def _record(rec: dict, part: str, method: str, L: int, B: int, channels: int, device: torch.device) -> dict:
    rec = dict(part=part, method=method, seq_len=L, batch=B, channels=channels, threads=torch.get_num_threads(),
               device=str(device), **rec)
    rec["us_per_token"] = rec["total_s"] / (L - 1) * 1e6
    rec["tokens_per_s"] = (L - 1) / rec["total_s"]
    return rec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lcsm.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small lengths, e2e at 256 only (< 30 s)")
    p.add_argument("--out", default="outputs/lcsm_bench", help="folder for results.json and results.png")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 2^10 .. 2^17)")
    p.add_argument("--methods", nargs="+", help="methods (default all): lazy eager recompute flash flash_batched "
                   "flash_unbatched flash_<tau>")
    p.add_argument("--parts", nargs="+", default=["mixer", "e2e"], help="mixer and/or e2e")
    p.add_argument("--e2e-max-len", type=int, help="longest e2e length (default 2^15, quick 2^8)")
    p.add_argument("--channels", type=int, default=64, help="mixer channels D (also the e2e model width)")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 and 8, a serving shape; quick 1)")
    p.add_argument("--layers", type=int, default=4, help="e2e model layers (x order 2 long convolutions)")
    p.add_argument("--budget", type=float, help="seconds a quadratic method may take at one length (default 60, "
                   "quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny FFTs slow down with more on a "
                   "loaded box)")
    p.add_argument("--decode", choices=list(DECODES), help="e2e: the decode step outside the long convolutions, "
                   "the same for every method: native (in C, built in about a second; the default on a CPU with a "
                   "C compiler), compiled by AOTInductor (built once per machine and shape, about 30 s) or eager "
                   "(the default otherwise)")
    p.add_argument("--tensor-steps", action="store_true", help="lazy's and flash's steps as tensor ops, not in C "
                   "(by default both run in C where a C compiler is, so that the comparison stays fair)")
    p.add_argument("--block", type=int, help="flash: the base block, below which a step sums its block itself "
                   "(a power of two; default 64 with the C step, 16 with tensor ops)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=list(HYENADNA_CONFIGS), help="e2e generation by a HyenaDNA of that published "
                   "configuration (random weights): flash vs lazy at batch 1, lengths 2^12 .. 2^18 by default, "
                   "lazy extrapolated beyond its budget (default 120 s)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, lengths: list[int], methods: list[str], device: torch.device) -> list[str]:
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
    if args.block is not None and (args.block < 1 or args.block & (args.block - 1)):
        errors.append(f"--block must be a power of two >= 1, got {args.block}")
    if min(args.channels, *args.batch, args.layers, args.threads) < 1:
        errors.append("--channels, --batch, --layers and --threads must be >= 1")
    if "flash_triton" in methods and not triton_available(device):
        errors.append("flash_triton needs Triton and a CUDA device; drop it from --methods")
    return errors


def run_part(part: str, B: int, lengths: list[int], methods: list[str], args, device, budget: float) -> list[dict]:
    """Every method at every length for one part and batch; a quadratic method stops where it would pass budget."""
    records, over, e2e_cache = [], set(), {}
    for L in sorted(lengths):
        for method in methods:
            if (part == "mixer" and method in ("flash_batched", "flash_unbatched")) or method in over:
                continue  # one slot: the same as flash
            limit = budget if method in QUADRATIC else float("inf")
            try:
                if part == "mixer":
                    rec = bench_mixer(method, L, args.channels, B, device, limit, block=args.block,
                                      tensor_steps=args.tensor_steps)
                else:
                    rec = bench_e2e(method, L, args.channels, B, args.layers, device, limit, e2e_cache,
                                    decode=args.decode, block=args.block, tensor_steps=args.tensor_steps)
            except MemoryError as e:
                print(f"  {part} {method}: skipped from L={L} ({e})")
                over.add(method)
                continue
            if rec is None:
                over.add(method)
                print(f"  {part} {method} B={B}: stopped at L={L} after the {budget:.0f} s budget; skipped from here")
                continue
            rec = _record(rec, part, method, L, B, args.channels, device)
            records.append(rec)
            print(f"  {part} {method} B={B} L={L}: {rec['total_s']:.3f} s, err {rec['max_abs_err']:.1e}", flush=True)
            next_L = min((x for x in lengths if x > L), default=None)
            if method in QUADRATIC and next_L and rec["total_s"] * (next_L / L) ** 2 > budget:
                over.add(method)
                print(f"  {part} {method} B={B}: skipped from L={next_L} (predicted over the {budget:.0f} s budget)")
    return records


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
    start = time.perf_counter()
    args = parse_args(argv)
    device = check_device(args.device)
    check_writable(args.out, "--out", "give another folder")  # before the benchmark, not after it
    out = Path(args.out)
    if args.model:
        from lcsm.inference.bench_hyenadna import main_model  # the --model path imports this module's timing

        return main_model(args, device, out, start)
    lengths = args.lengths or ([2**8, 2**10, 2**12] if args.quick else [2**k for k in range(10, 18)])
    budget = args.budget if args.budget is not None else (3.0 if args.quick else 60.0)
    e2e_max_len = args.e2e_max_len or (2**8 if args.quick else 2**15)
    methods = args.methods or all_methods(device)
    args.batch = args.batch or ([1] if args.quick else [1, 8])
    args.decode = args.decode or ("native" if native.available(device, torch.float32) else "eager")
    errors = check_args(args, lengths, methods, device)
    if errors:
        raise UserError(errors[0])
    torch.set_num_threads(args.threads)
    timing = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"lcsm.bench on {device} ({timing}), {torch.get_num_threads()} thread(s), float32, D={args.channels}, "
          f"B={' '.join(map(str, args.batch))}, e2e layers={args.layers} (order 2, {args.decode} decode step), "
          f"budget {budget:.0f} s per "
          "quadratic run")
    records: list[dict] = []
    for part in args.parts:
        part_lengths = [L for L in lengths if part == "mixer" or L <= e2e_max_len]
        part_methods = [m for m in methods if part == "mixer" or args.methods or m in E2E_METHODS]
        for B in args.batch:
            records += run_part(part, B, part_lengths, part_methods, args, device, budget)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    bench_report.plot(records, out / "results.png")
    bench_report.print_table(records)
    bench_report.print_tiles(records)
    ratios = bench_report.ratio_summary(records)
    print("\n".join(ratios))
    headline = [line for line in ratios if "than lazy" in line][-1:]
    figure = ", ".join(headline + [f"max error {max(r['max_abs_err'] for r in records):.1e}"] * bool(records))
    report_done(f"{len(records)} benchmark runs", time.perf_counter() - start, figure,
                f"{out} (results.json, results.png)")
    return 0




if __name__ == "__main__":
    run(main)
