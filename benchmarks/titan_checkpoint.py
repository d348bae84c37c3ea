"""Checkpoint costs, side by side in one process: DCP save/load throughput vs plain torch.save/torch.load,
and the training step time with a checkpoint every step, sync vs async (the async staging overlap).

    python benchmarks/titan_checkpoint.py [--steps 6] [--out outputs/bench_checkpoint]
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

from titan.checkpoint.safe_reader import SafeFileSystemReader
from titan.config import parse_args
from titan.metrics.logging import init_logger
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
        dcp.load(target, storage_reader=SafeFileSystemReader(str(folder / "dcp")))
        times["dcp_load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(folder / "plain.pt", weights_only=True)
        times["torch_load"].append(time.perf_counter() - t0)
    mbps = {k: mb / statistics.median(v) for k, v in times.items()}
    return {"state_mib": mb, **{f"{k}_mib_s": v for k, v in mbps.items()},
            "save_ratio_dcp_vs_torch": mbps["dcp_save"] / mbps["torch_save"],
            "load_ratio_dcp_vs_torch": mbps["dcp_load"] / mbps["torch_load"]}


def step_times(out: Path, steps: int, mode: str) -> float:
    folder = out / f"run_{mode}"
    shutil.rmtree(folder, ignore_errors=True)
    config = parse_args(["--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "1",
                         "--checkpoint.async_mode", mode, "--metrics.log_freq", "1", "--validation.enable", "false",
                         "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(folder)])
    trainer = Trainer(config)
    trainer.train()
    trainer.close()
    elapsed = [r["elapsed_s"] for r in trainer.history]
    per_step = [b - a for a, b in zip(elapsed, elapsed[1:])]
    return statistics.median(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="outputs/bench_checkpoint")
    args = parser.parse_args()
    init_logger()
    out = Path(args.out)
    config = parse_args(["--training.steps", "1", "--validation.enable", "false", "--metrics.enable_jsonl", "false",
                         "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(out / "probe")])
    probe = Trainer(config)
    probe.train()
    result = throughput(probe, out / "io")
    sync_s, async_s = step_times(out, args.steps, "disabled"), step_times(out, args.steps, "async")
    result.update({"step_s_with_sync_save": sync_s, "step_s_with_async_save": async_s,
                   "async_vs_sync_step_time": async_s / sync_s})
    (out / "results.json").write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(f"{k:28s} {v:10.3f}")


if __name__ == "__main__":
    main()
