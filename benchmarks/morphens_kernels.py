"""Does morphens.native (BatchNorm + ReLU + the 2x2 max pooling of a VGG block, in C) beat the best torch option?
Side by side, in one run.

For the fashion sweep's mother and its first member (configs/morphens/fashion_sweep.toml, K = 8, batch 256 and
128) it times one training step (forward, backward, AdamW) under each option, rounds interleaved so that a
machine's load moves every option alike:
- `native-1t`: eager on 1 thread with morphens.native serving (morphens' default where it builds);
- `eager-Nt`: torch's ops only (`MORPHENS_NATIVE=0`: models.bn_relu and F.max_pool2d), N = 1 and 2 threads;
- `compile-Nt`: the net under torch.compile (inductor's fused C++; native never serves there), N = 1 and 2;
- `torch-bn-1t`: eager on 1 thread with torch's own BatchNorm + ReLU instead of models.bn_relu.
native earns its place where its step beats the best torch option by 1.3x or more (the C kernels removed
earlier, src/morphens/kernels.c, were measured by this script at 948a282). The 2-thread options use both cores
for one net; to compare with two nets at once on one thread each (as `--training.spread members` runs them), run
two copies of the script at the same time with one option each and add up their steps.

`python benchmarks/morphens_kernels.py [--steps 20] [--rounds 3] [--clock wall|cpu] [--options a,b]
[--out outputs/bench/morphens_kernels]` prints a table and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from morphens import models
from morphens.config import load_config
from morphens.data import Loader, load
from morphens.experiment import members_of
from morphens.mother import cluster, mother_of
from morphens.train import seeded

CONFIG = Path(__file__).resolve().parents[1] / "configs/morphens/fashion_sweep.toml"
KEEP_RATIO = 1.3
BN_RELU = models.bn_relu


def use_path(native: bool, torch_bn: bool) -> None:
    """morphens.native on or off (its one switch); torch's own BatchNorm + ReLU for models.bn_relu if torch_bn."""
    os.environ["MORPHENS_NATIVE"] = "1" if native else "0"
    models.bn_relu = (lambda x, bn: F.relu(bn(x))) if torch_bn else BN_RELU


def stepper(net: torch.nn.Module, compiled: bool):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model = torch.compile(net) if compiled else net

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def options() -> dict[str, tuple[int, bool, bool, bool]]:
    """name -> (threads, compiled, native, torch's BatchNorm)."""
    out = {"native-1t": (1, False, True, False)}
    out |= {f"eager-{n}t": (n, False, False, False) for n in (1, 2)}
    out |= {f"compile-{n}t": (n, True, False, False) for n in (1, 2)}
    out["torch-bn-1t"] = (1, False, False, True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU time, steadier on a loaded machine (all threads summed)")
    p.add_argument("--options", default="", help="comma-separated subset of the options (default all)")
    p.add_argument("--out", default="outputs/bench/morphens_kernels")
    args = p.parse_args()
    chosen = options()
    if args.options:
        unknown = set(args.options.split(",")) - set(chosen)
        if unknown:
            p.error(f"--options: unknown {', '.join(sorted(unknown))}; choose from {', '.join(chosen)}")
        chosen = {name: chosen[name] for name in args.options.split(",")}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = load_config(str(CONFIG))
    data = load(cfg.data.dataset, cfg.data.path)
    members = members_of(cfg, data)[:8]
    first = cluster(members, cfg.mothernet.clusters_for(8))[0]
    nets = {"mother": (mother_of([members[i] for i in first]), cfg.mothernet.batch_size),
            "member": (members[first[0]], cfg.training.batch_size)}
    times: dict[tuple[str, str], list[float]] = {}
    for net_name, (arch, batch) in nets.items():
        x, y = next(iter(Loader(data, batch, limit=cfg.data.train_limit)))
        steps = {}
        for name, (threads, compiled, native, torch_bn) in chosen.items():
            torch.set_num_threads(threads)
            use_path(native, torch_bn)
            steps[name] = stepper(seeded(arch, 0).train(), compiled)
            for _ in range(3):  # compile, build the C library, warm caches
                steps[name](x, y)
        for _ in range(args.rounds):
            for name, (threads, _, native, torch_bn) in chosen.items():
                torch.set_num_threads(threads)
                use_path(native, torch_bn)
                start = clock()
                for _ in range(args.steps):
                    steps[name](x, y)
                times.setdefault((net_name, name), []).append((clock() - start) / args.steps * 1e3)
    rows = []
    for net_name in nets:
        ms = {name: statistics.median(times[(net_name, name)]) for name in chosen}
        best_torch = min((name for name in ms if name.startswith(("eager", "compile"))), key=ms.get, default=None)
        for name, value in ms.items():
            rows.append({"net": net_name, "option": name, "step_ms": value, "best_torch": best_torch,
                         "vs_best_torch": ms[best_torch] / value if best_torch else None})
    print(f"{'net':<7} {'option':<12} {'step ms':>8} {'best torch / this':>18}")
    for r in rows:
        ratio = f"{r['vs_best_torch']:>17.2f}x" if r["best_torch"] else f"{'-':>18}"
        print(f"{r['net']:<7} {r['option']:<12} {r['step_ms']:>8.2f} {ratio}")
    for r in (r for r in rows if r["option"] == "native-1t" and r["best_torch"]):
        verdict = "earns" if r["vs_best_torch"] >= KEEP_RATIO else "misses"
        print(f"native on the {r['net']}'s step: {r['vs_best_torch']:.2f}x the best torch option "
              f"({r['best_torch']}); {verdict} the {KEEP_RATIO}x bar")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"steps": args.steps, "rounds": args.rounds, "clock": args.clock, "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
