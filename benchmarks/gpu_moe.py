"""The MoE layer on CUDA (a benchmark): grouped GEMM vs the per-expert loop vs a dense SwiGLU of the same active
FLOPs, and the expert-parallel all-to-all dispatch and combine over NCCL.

    python benchmarks/gpu_moe.py [--dry-run] [--out moe.json]

Layer: bf16, forward + backward, 16,384 tokens of dim 4096 through 64 experts top-8 of hidden 1024 (dense: hidden
8192), median of the timed iterations; TFLOP/s count the matmuls only (the router's dim x experts included).
Expert parallel: one rank per visible GPU (NCCL), EP over all of them, the same layer's experts split over the
ranks; it times the layer with EP and the two all-to-alls alone, reporting their bytes per rank. With one GPU the
all-to-all stays on the device (EP 1): the figure is the dispatch's own overhead, not a link's bandwidth.
`--dry-run`: the CPU, gloo, 2 ranks, tiny shapes, fp32. benchmarks/gpu_check.sh runs it first with `--if-gpu`
and its own arguments (unless --part picks parts): it reads --dry-run and leaves the others, prints its table to
the console (gpu_check's folder holds as many files as travel back from the GPU machine), and leaves the refusal
without a GPU to gpu_check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan.models.common.decoder import FeedForward
from titan.models.common.moe import MoE, MoEArgs

FULL = {"tokens": 16384, "dim": 4096, "experts": 64, "top_k": 8, "hidden": 1024, "iters": 10}
DRY = {"tokens": 256, "dim": 64, "experts": 8, "top_k": 2, "hidden": 32, "iters": 2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _layer(s: dict, grouped: bool, device: torch.device, dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    moe = MoE(s["dim"], MoEArgs(num_experts=s["experts"], top_k=s["top_k"], hidden_dim=s["hidden"],
                                use_grouped_mm=grouped))
    moe.init_weights(0.02)
    return moe.to(device, dtype)


def layer_part(s: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    x = torch.randn(1, s["tokens"], s["dim"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    dense = FeedForward(s["dim"], s["top_k"] * s["hidden"])
    dense.init_weights(0.02)
    variants = {"dense": dense.to(device, dtype), "grouped_mm": _layer(s, True, device, dtype),
                "loop": _layer(s, False, device, dtype)}
    flops = 6 * s["tokens"] * s["dim"] * (3 * s["top_k"] * s["hidden"])
    rows = []
    for name, module in variants.items():
        seconds = _time(lambda m=module: m(x).backward(grad), device, s["iters"])
        extra = 6 * s["tokens"] * s["dim"] * s["experts"] if name != "dense" else 0
        rows.append({"part": "layer", "variant": name, "ms": seconds * 1e3,
                     "tflops": (flops + extra) / seconds / 1e12})
    for row in rows:
        row["vs_dense"] = row["ms"] / rows[0]["ms"]
    return rows


def _ep_rank(rank: int, world: int, store: str, s: dict, dry: bool, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titan.distributed.comm_stats import CommStats
    from titan.distributed.expert_parallel import _Dispatch, apply_expert_parallel

    device = torch.device("cpu") if dry else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if dry else "nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    dtype = torch.float32 if dry else torch.bfloat16
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    moe = _layer(s, True, device, dtype)
    apply_expert_parallel(moe, mesh)
    x = torch.randn(1, s["tokens"], s["dim"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    layer_s = _time(lambda: moe(x).backward(grad), device, s["iters"])
    # The dispatch and combine alone, on the layer's own routing.
    x_TD = x.detach().view(-1, s["dim"])
    _, experts_TK, _ = moe.router(x_TD)
    counts_E = torch.bincount(experts_TK.flatten(), minlength=s["experts"])
    copies = x_TD[experts_TK.flatten().argsort(stable=True) // s["top_k"]]
    dispatch = _Dispatch(mesh)

    def round_trip():
        received, local_counts = dispatch.pre_hook(None, (copies, counts_E))
        dispatch.hook(None, (), received)

    a2a_s = _time(round_trip, device, s["iters"])
    with CommStats() as stats:
        round_trip()
    nbytes = sum(v["bytes"] for (kind, _), v in stats.table().items() if kind == "all_to_all")
    if rank == 0:
        with open(out, "w") as f:
            json.dump([{"part": "expert_parallel", "variant": f"EP {world} layer", "ms": layer_s * 1e3},
                       {"part": "expert_parallel", "variant": f"EP {world} all-to-all round trip",
                        "ms": a2a_s * 1e3, "bytes_per_rank": nbytes, "gb_per_s": nbytes / a2a_s / 1e9}], f)
    dist.barrier()
    dist.destroy_process_group()


def ep_part(s: dict, dry: bool) -> list[dict]:
    world = 2 if dry else max(torch.cuda.device_count(), 1)
    with tempfile.TemporaryDirectory(prefix="gpu_moe-") as folder:
        out = os.path.join(folder, "ep.json")
        mp.start_processes(_ep_rank, args=(world, os.path.join(folder, "store"), s, dry, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the CPU, gloo, 2 ranks, tiny shapes")
    p.add_argument("--out", help="write the records as JSON here")
    p.add_argument("--if-gpu", action="store_true", help="without a GPU (and --dry-run), do nothing and exit 0")
    a, _ = p.parse_known_args(argv)
    if a.if_gpu and not a.dry_run and not torch.cuda.is_available():
        return 0
    if not a.dry_run and not torch.cuda.is_available():
        print("error: benchmarks/gpu_moe.py needs a CUDA GPU and torch sees none; --dry-run runs it on the CPU",
              file=sys.stderr)
        return 2
    s = DRY if a.dry_run else FULL
    device = torch.device("cpu" if a.dry_run else "cuda")
    rows = layer_part(s, device, torch.float32 if a.dry_run else torch.bfloat16) + ep_part(s, a.dry_run)
    print(f"MoE layer: {s['tokens']} tokens, dim {s['dim']}, {s['experts']} experts top-{s['top_k']}, hidden "
          f"{s['hidden']}, {'fp32 CPU (dry run)' if a.dry_run else 'bf16 ' + torch.cuda.get_device_name()}")
    for r in rows:
        extra = "".join(f"  {k} {v:.3g}" for k, v in r.items() if k not in ("part", "variant", "ms"))
        print(f"  {r['variant']:32s} {r['ms']:9.2f} ms{extra}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
