"""Did morphens' C kernels (src/morphens/kernels.c) beat the best torch option? Side by side, in one run.

None beat it by 1.3x on both nets, so they were removed after this comparison (benchmarks/RESULTS.md); their
options run at a commit that still has src/morphens/fused.py (948a282), and the torch options run anywhere.

For the fashion sweep's mother and its first member (configs/morphens/fashion_sweep.toml, K = 8, batch 256 and
128) it times one training step (forward, backward, AdamW) under each option, rounds interleaved so that a
machine's load moves every option alike:
- `eager-Nt`: torch's own ops, N = 1 and 2 threads;
- `compile-Nt`: the net under torch.compile (inductor's fused C++), N = 1 and 2 threads;
- `c-<kernel>`: eager on 1 thread (the kernels are serial) with one C kernel serving the net, and `c-all` with all;
- `torch-bn-1t`: eager on 1 thread with torch's BatchNorm + ReLU instead of `models.bn_relu` (which runs over
  (rows, k * C) views of channels-last memory), at commits that have it.
A kernel earns its place where its step beats the best torch option by 1.3x or more.

`python benchmarks/morphens_kernels.py [--steps 20] [--rounds 3] [--clock wall|cpu] [--options a,b]
[--out outputs/bench/morphens_kernels]` prints
a table and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from morphens import models

try:
    from morphens import fused
except ImportError:  # the kernels' removal: only the torch options remain
    fused = None
from morphens.config import load_config
from morphens.data import Loader, load
from morphens.experiment import members_of
from morphens.mother import cluster, mother_of
from morphens.train import seeded

CONFIG = Path(__file__).resolve().parents[1] / "configs/morphens/fashion_sweep.toml"
TORCH_OPS = {"bn_relu": lambda x, bn: F.relu(bn(x)), "max_pool2": lambda x: F.max_pool2d(x, 2),
             "conv": lambda x, conv2d: conv2d(x)}
C_OPS = {name: getattr(fused, name) for name in TORCH_OPS} if fused else {}
KEEP_RATIO = 1.3


BN_RELU = getattr(models, "bn_relu", None)


def use_kernels(names: set[str]) -> None:
    """Routes models' layers through the C kernels named, torch's ops for the rest; "torch-bn" swaps
    models.bn_relu for torch's own BatchNorm + ReLU."""
    if BN_RELU:
        models.bn_relu = (lambda x, bn: F.relu(bn(x))) if "torch-bn" in names else BN_RELU
    if fused:
        for name in TORCH_OPS:
            setattr(models, name, C_OPS[name] if name in names else TORCH_OPS[name])


def stepper(net: torch.nn.Module, compiled: bool):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model = torch.compile(net) if compiled else net

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def options() -> dict[str, tuple[int, bool, set[str]]]:
    """name -> (threads, compiled, C kernels)."""
    out = {f"eager-{n}t": (n, False, set()) for n in (1, 2)}
    out |= {f"compile-{n}t": (n, True, set()) for n in (1, 2)}
    if BN_RELU:
        out["torch-bn-1t"] = (1, False, {"torch-bn"})
    if fused:
        out |= {f"c-{name}": (1, False, {name}) for name in TORCH_OPS}
        out["c-all"] = (1, False, set(TORCH_OPS))
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
        for name, (threads, compiled, kernels) in chosen.items():
            torch.set_num_threads(threads)
            use_kernels(kernels)
            steps[name] = stepper(seeded(arch, 0).train(), compiled)
            for _ in range(3):  # compile, build the C library, warm caches
                steps[name](x, y)
        for _ in range(args.rounds):
            for name, (threads, _, kernels) in chosen.items():
                torch.set_num_threads(threads)
                use_kernels(kernels)
                start = clock()
                for _ in range(args.steps):
                    steps[name](x, y)
                times.setdefault((net_name, name), []).append((clock() - start) / args.steps * 1e3)
    rows = []
    for net_name in nets:
        ms = {name: statistics.median(times[(net_name, name)]) for name in chosen}
        best_torch = min((name for name in ms if not name.startswith("c-") and name != "torch-bn-1t"), key=ms.get)
        for name, value in ms.items():
            rows.append({"net": net_name, "option": name, "step_ms": value, "best_torch": best_torch,
                         "vs_best_torch": ms[best_torch] / value})
    print(f"{'net':<7} {'option':<12} {'step ms':>8} {'best torch / this':>18}")
    for r in rows:
        print(f"{r['net']:<7} {r['option']:<12} {r['step_ms']:>8.2f} {r['vs_best_torch']:>17.2f}x")
    for name in (n for n in chosen if n.startswith("c-")):
        worst = min(r["vs_best_torch"] for r in rows if r["option"] == name)
        print(f"{name}: {'keep' if worst >= KEEP_RATIO else 'remove'} (worst net {worst:.2f}x the best torch option)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"steps": args.steps, "rounds": args.rounds, "clock": args.clock, "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
