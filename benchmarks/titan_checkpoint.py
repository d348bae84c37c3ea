"""Checkpoint costs, side by side in one process: DCP save/load throughput vs plain torch.save/torch.load,
and how long the training loop is blocked per save, sync vs async (staging into a reused buffer vs a fresh copy).

Blocked time per save = the time inside `save()` until control returns (in async mode: the wait for the
previous save to finish plus staging this one) plus the wait for the last save at `close()`, over the number
of saves; reported split into staging and waits, and the last save's wait at close on its own (it has no
steps to overlap with). The full save time is the sync save's. The model is the debug Llama widened (`--dim`,
`--n_layers`) so that one save takes about a second on a CPU, and saves come every `--interval` steps so that
background writes have steps to overlap with. Runs alternate sync/async `--repeats` times; medians are reported.

    python benchmarks/titan_checkpoint.py [--steps 6] [--interval 2] [--dim 512] [--n_layers 8] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titan.components.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from titan.config import parse_args
from titan.tools.logging import init_logger
from titan.trainer import Trainer


def state_bytes(state) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def throughput(trainer: Trainer, folder: Path, repeats: int = 3) -> dict:
    state = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    state.update({f"optim.{i}.{k}": v for i, s in trainer.optimizers[0].state_dict()["state"].items()
                  for k, v in s.items() if isinstance(v, torch.Tensor)})
    mb = state_bytes(state) / 2**20
    times = {"dcp_save": [], "torch_save": [], "dcp_load": [], "torch_load": []}
    for _ in range(repeats):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(folder / "dcp"))
        times["dcp_save"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.save(state, folder / "plain.pt")
        times["torch_save"].append(time.perf_counter() - t0)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=SafeFileSystemReader(str(folder / "dcp")), planner=SafeLoadPlanner())
        times["dcp_load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(folder / "plain.pt", weights_only=True)
        times["torch_load"].append(time.perf_counter() - t0)
    mbps = {k: mb / statistics.median(v) for k, v in times.items()}
    return {"state_mib": mb, **{f"{k}_mib_s": v for k, v in mbps.items()},
            "save_ratio_dcp_vs_torch": mbps["dcp_save"] / mbps["torch_save"],
            "load_ratio_dcp_vs_torch": mbps["dcp_load"] / mbps["torch_load"]}


def model_args(args) -> list[str]:
    # Short sequences keep the step short, so the cost of a save is not lost in the compute.
    return ["--model.dim", str(args.dim), "--model.n_layers", str(args.n_layers), "--training.seq_len", "32",
            "--training.local_batch_size", "1", "--training.mixed_precision_param", "float32",
            "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]


def save_costs(out: Path, args, mode: str) -> dict:
    """A run saving every `interval` steps in `mode` timed around its saves: "disabled" (sync), "async" (staging
    into a reused buffer), "async_fresh" (a new staging copy per save) or "none" (no checkpoints)."""
    folder = out / f"run_{mode}"
    shutil.rmtree(folder, ignore_errors=True)
    ckpt = [] if mode == "none" else ["--checkpoint.enable", "--checkpoint.interval", str(args.interval),
                                      "--checkpoint.async_mode", "async" if mode.startswith("async") else mode,
                                      "--checkpoint.reuse_staging_buffer", str(mode != "async_fresh").lower()]
    trainer = Trainer(parse_args([*model_args(args), *ckpt, "--training.steps", str(args.steps),
                                  "--metrics.log_freq", "1", "--job.dump_folder", str(folder)]))
    timed = {"save": [], "wait": []}
    for name, times in timed.items():
        method = getattr(trainer.checkpointer, name)

        def timed_call(*a, _method=method, _times=times, **k):
            t0 = time.perf_counter()
            _method(*a, **k)
            _times.append(time.perf_counter() - t0)

        setattr(trainer.checkpointer, name, timed_call)
    t0 = time.perf_counter()
    trainer.train()
    t1 = time.perf_counter()
    trainer.close()  # in async mode: the wait for the last save
    t2 = time.perf_counter()
    saves = len(timed["save"]) or 1
    # save() calls wait() for the previous save first: the waits are part of the blocked time, not extra.
    blocked = sum(timed["save"]) + t2 - t1
    return {"blocked_per_save_s": blocked / saves, "saves": len(timed["save"]),
            "staging_per_save_s": (blocked - sum(timed["wait"])) / saves, "final_wait_s": t2 - t1,
            "step_s": (t2 - t0) / args.steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--interval", type=int, default=2, help="steps between saves")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n_layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="sync/async/no-checkpoint runs, alternating")
    parser.add_argument("--out", default="outputs/bench_checkpoint")
    args = parser.parse_args()
    init_logger()
    out = Path(args.out)
    probe = Trainer(parse_args([*model_args(args), "--training.steps", "1", "--metrics.enable_jsonl", "false",
                                "--job.dump_folder", str(out / "probe")]))
    probe.train()
    result = {"params_m": sum(p.numel() for p in probe.model.parameters()) / 1e6, **throughput(probe, out / "io")}
    runs: dict[str, list[dict]] = {"disabled": [], "async": [], "async_fresh": [], "none": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(save_costs(out, args, mode))
    median = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    sync, asyn, fresh, none = median["disabled"], median["async"], median["async_fresh"], median["none"]
    result.update({
        "steps": args.steps,
        "interval": args.interval,
        "saves_per_run": sync["saves"],
        "full_save_s": sync["blocked_per_save_s"],  # a sync save blocks for all of it
        "blocked_per_save_s_async": asyn["blocked_per_save_s"],
        "async_staging_s": asyn["staging_per_save_s"],
        "async_waits_s": asyn["blocked_per_save_s"] - asyn["staging_per_save_s"],
        "async_final_wait_s": asyn["final_wait_s"],
        "async_staging_s_fresh_buffer": fresh["staging_per_save_s"],
        "staging_reused_vs_fresh": asyn["staging_per_save_s"] / fresh["staging_per_save_s"],
        "blocked_async_vs_sync": asyn["blocked_per_save_s"] / sync["blocked_per_save_s"],
        "step_s_no_checkpoint": none["step_s"],
        "step_s_sync": sync["step_s"],
        "step_s_async": asyn["step_s"],
        "step_time_async_vs_sync": asyn["step_s"] / sync["step_s"],
        "save_cost_async_vs_sync": (asyn["step_s"] - none["step_s"]) / (sync["step_s"] - none["step_s"]),
    })
    (out / "results.json").write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(f"{k:28s} {v:10.3f}")


if __name__ == "__main__":
    main()
