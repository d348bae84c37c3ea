"""The MoE layer against a dense SwiGLU of the same active FLOPs, side by side in one process (a benchmark).

    python benchmarks/moe_layer.py [--tokens 4096] [--dim 512] [--experts 16] [--top-k 4] [--hidden 256]
                                   [--dtype float32|bfloat16] [--rounds 5] [--out results.json]

Dense: one SwiGLU of hidden top_k * hidden, so every token does the same matmul FLOPs as in the MoE layer (the
router's dim x experts product, 1-2 % here, is the MoE layer's extra). Each variant runs forward and backward;
the rounds interleave the variants so that load from other processes hits them alike, and the median per
variant is reported with its ratio to dense, in wall time and in this process's CPU time (steadier on a shared
machine: time spent waiting for a core is not in it). Variants: the exact per-expert fallback ("loop"), the grouped GEMM
where the dtype has one ("grouped_mm"), and routing forced to be balanced ("loop balanced": every expert gets
the same number of tokens), which separates the cost of uneven loads from that of the dispatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from titan.models.common.decoder import FeedForward
from titan.models.common.moe import MoE, MoEArgs, grouped_mm_supported


def _step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    module(x).backward(grad)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="each expert's SwiGLU hidden size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); on a loaded machine 1 is fairer, "
                   "since each of the many small per-expert ops waits for every thread of its parallel region")
    p.add_argument("--out", help="write the records as JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    x = torch.randn(1, a.tokens, a.dim, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def moe(grouped: bool, balanced: bool = False) -> MoE:
        layer = MoE(a.dim, MoEArgs(num_experts=a.experts, top_k=a.top_k, hidden_dim=a.hidden,
                                   use_grouped_mm=grouped))
        layer.init_weights(0.02)
        if balanced:  # every token's k experts in turn: each expert gets exactly tokens * k / experts copies
            experts = (torch.arange(a.tokens)[:, None] * a.top_k + torch.arange(a.top_k)) % a.experts
            weights = torch.full((a.tokens, a.top_k), 1.0 / a.top_k)
            layer.router.forward = lambda x_TD: (weights, experts, None)
        return layer.to(dtype)

    dense = FeedForward(a.dim, a.top_k * a.hidden)
    dense.init_weights(0.02)
    variants = {"dense": dense.to(dtype), "loop": moe(False), "loop balanced": moe(False, balanced=True)}
    if grouped_mm_supported(x):
        variants["grouped_mm"] = moe(True)
    times = {name: [] for name in variants}
    cpu_times = {name: [] for name in variants}
    for module in variants.values():  # warm-up
        _step(module, x, grad)
    for r in range(a.rounds):
        names = list(variants)
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, cpu_start = time.perf_counter(), time.process_time()
            _step(variants[name], x, grad)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    dense_s, dense_cpu_s = statistics.median(times["dense"]), statistics.median(cpu_times["dense"])
    records = []
    print(f"{a.tokens} tokens, dim {a.dim}, {a.experts} experts top-{a.top_k} hidden {a.hidden}, {a.dtype}, "
          f"{torch.get_num_threads()} threads; forward + backward, median of {a.rounds}")
    for name, ts in times.items():
        median, cpu = statistics.median(ts), statistics.median(cpu_times[name])
        records.append({"variant": name, "median_s": median, "vs_dense": median / dense_s, "times_s": ts,
                        "median_cpu_s": cpu, "cpu_vs_dense": cpu / dense_cpu_s,
                        "tokens": a.tokens, "dim": a.dim, "experts": a.experts, "top_k": a.top_k,
                        "hidden": a.hidden, "dtype": a.dtype, "threads": torch.get_num_threads()})
        print(f"  {name:14s} {median * 1e3:8.1f} ms  {median / dense_s:5.2f}x dense | CPU {cpu * 1e3:8.1f} ms  "
              f"{cpu / dense_cpu_s:5.2f}x dense")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
