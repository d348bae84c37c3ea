"""`python -m lcsm.bench --model hyenadna-<name>`: generation by a HyenaDNA of a published configuration (random
weights), flash vs lazy at batch 1; lazy beyond its budget is extrapolated from its measured time per token (linear
in L) and marked as such. The timing is lcsm.inference.bench's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from lcsm.inference import bench_report
from lcsm.inference.bench import QUADRATIC, _generate, _plan, _record, method_options
from lcsm.inference.decode import new_decode_state
from lcsm.model.hyenadna import HYENADNA_CONFIGS, HyenaDNA
from titan.tools.cli import UserError, report_done


def bench_hyenadna(method: str, L: int, name: str, device: torch.device, budget: float, cache: dict) -> dict | None:
    """One generation of L - 1 tokens after a one-token prompt by a HyenaDNA of a published configuration (random
    weights), batch 1, eager decode step, flash's tiles per slot; the last logits are checked against the parallel
    forward."""
    if L not in cache:
        cache.clear()
        torch.manual_seed(0)
        model = HyenaDNA(HYENADNA_CONFIGS[name]).to(device)
        model.init_weights()
        tokens = torch.randint(0, model.args.vocab_size, (1, L), device=device)
        with torch.no_grad():
            last_logits = model(tokens)[:, -1]
        cache[L] = (model, tokens, last_logits)
    model, tokens, ref = cache[L]
    engine, options = method_options(method)
    if engine == "flash":  # tiles per slot: one tile for every slot at L = 2^18 would hold GBs of FFT buffers
        options["batch_layers"] = False
    state = new_decode_state(model, engine, 1, length=L, **options)
    if engine == "flash":
        _choose_taus(state.engine)
    timed = _generate(state, tokens, device, budget)
    if timed is None:
        return None
    logits, times = timed
    return dict(**times, decode="eager", max_abs_err=(logits - ref).abs().max().item(), layers=model.args.n_layer,
                model=name,
                extrapolated=False, **_plan(state.engine))


def _choose_taus(engine) -> None:
    """Hybrid tau's timed choice for every tile size, made before the clock starts (on the engine's zero inputs)."""
    for U in engine.sizes:
        if U > engine.c_tiles:
            taus = [engine.tau] if engine.batched[U] else engine.slot_taus
            rows = engine.y_rows if engine.batched[U] else engine.y_rows[: engine.D]
            for tau in taus:
                tau(rows[..., :U])


def extrapolate_lazy(records: list[dict], lengths: list[int]) -> list[dict]:
    """lazy at the lengths it was not run at: its time per token is linear in L (each step reads the whole history),
    a + b L fitted to its measured records (at least two); marked extrapolated."""
    measured = [r for r in records if r["method"] == "lazy" and not r["extrapolated"]]
    if len(measured) < 2:
        return []
    Ls = torch.tensor([float(r["seq_len"]) for r in measured], dtype=torch.float64)
    per_token = torch.tensor([r["us_per_token"] for r in measured], dtype=torch.float64)
    slope, intercept = torch.linalg.lstsq(torch.stack([Ls, torch.ones_like(Ls)], 1), per_token[:, None]).solution[:, 0]
    done = {r["seq_len"] for r in measured}
    out = []
    for L in lengths:
        if L not in done:
            us = (slope * L + intercept).item()
            out.append(dict(measured[-1], seq_len=L, us_per_token=us, total_s=us * (L - 1) * 1e-6, mixer_s=None,
                            wall_s=None, max_abs_err=None, extrapolated=True))
    return out


def run_model(args, lengths: list[int], methods: list[str], device: torch.device, budget: float) -> list[dict]:
    records, over, cache = [], set(), {}
    for L in sorted(lengths):
        for method in methods:
            if method in over:
                continue
            limit = budget if method in QUADRATIC and sum(r["method"] == method for r in records) >= 2 else float("inf")
            rec = bench_hyenadna(method, L, args.model, device, limit, cache)
            if rec is None:
                over.add(method)
                print(f"  {method}: stopped at L={L} after the {budget:.0f} s budget; extrapolated from here")
                continue
            records.append(_record(rec, "e2e", method, L, 1, HYENADNA_CONFIGS[args.model].d_model, device))
            print(f"  {args.model} {method} L={L}: {rec['total_s']:.1f} s, {records[-1]['us_per_token']:.0f} "
                  f"us/token, err {rec['max_abs_err']:.1e}", flush=True)
            next_L = min((x for x in lengths if x > L), default=None)
            measured = sum(r["method"] == method for r in records)
            # lazy's slope needs two lengths: the budget stops it from its third on
            if method in QUADRATIC and next_L and measured >= 2 and rec["total_s"] * (next_L / L) ** 2 > budget:
                over.add(method)
                print(f"  {method}: predicted over the {budget:.0f} s budget from L={next_L}; extrapolated from there")
    if "lazy" in methods:
        records += extrapolate_lazy(records, lengths)
    return records


def main_model(args, device: torch.device, out: Path, start: float) -> int:
    lengths = args.lengths or [2**k for k in range(12, 19)]
    methods = args.methods or ["flash", "lazy"]
    budget = args.budget if args.budget is not None else 120.0
    errors = [f"--model runs flash and lazy; got --methods {' '.join(methods)}" for m in methods
              if m not in ("flash", "lazy")]
    errors += [f"--lengths must be in [2, {HYENADNA_CONFIGS[args.model].l_max}] (l_max)" for L in lengths
               if not 2 <= L <= HYENADNA_CONFIGS[args.model].l_max]
    if errors:
        raise UserError(errors[0])
    torch.set_num_threads(args.threads)
    timing = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"lcsm.bench --model {args.model} on {device} ({timing}), {torch.get_num_threads()} thread(s), float32, "
          f"batch 1, random weights, lazy budget {budget:.0f} s")
    records = run_model(args, lengths, methods, device, budget)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    bench_report.plot(records, out / "results.png")
    print("\n".join(bench_report.model_table(records)))
    flash = [r for r in records if r["method"] == "flash"]
    figure = f"flash {flash[-1]['us_per_token']:.0f} us/token at L={flash[-1]['seq_len']}" if flash else ""
    measured = sum(not r["extrapolated"] for r in records)
    report_done(f"{measured} {args.model} generations", time.perf_counter() - start, figure,
                f"{out} (results.json, results.png)")
    return 0
