"""Profiling of the training loop: torch.profiler traces and memory snapshots every `profiling.profile_freq` steps.

Files, under job.dump_folder, per rank r:
- <save_traces_folder>/iteration_<step>/rank<r>_trace.json: chrome trace of that step.
- <save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle (CUDA): the allocator's
  history, for https://pytorch.org/memory_viz; also iteration_<step>_oom/ when a step runs out of memory.
- On a CPU, which has no allocator history: <save_memory_snapshot_folder>/rank<r>_memory.jsonl, the process's
  resident memory after every step, and iteration_<step>/rank<r>_memory_ops.txt, the ops of that step ranked
  by the memory they allocated (the profiler's memory events), which is where a step's peak comes from.
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titan.components.metrics.throughput import peak_memory_gib
from titan.config.job_config import Profiling
from titan.tools.logging import logger

WARMUP_STEPS = 3
ACTIVE_STEPS = 1
MEMORY_HISTORY_ENTRIES = 100_000
MEMORY_OPS_ROWS = 25

# Each trace should hold its own window only, which is what this warning (once per process) is about.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")


def trace_schedule(freq: int, start_step: int) -> Callable[[int], ProfilerAction]:
    """Wait/warm-up/record windows that record each step whose number is a multiple of `freq`.

    The profiler counts its own steps from 0; `start_step` (the steps done before, e.g. on resume) aligns them
    with training steps.
    """
    warmup = min(WARMUP_STEPS, freq - ACTIVE_STEPS)
    window = torch.profiler.schedule(wait=freq - warmup - ACTIVE_STEPS, warmup=warmup, active=ACTIVE_STEPS)
    return lambda profiler_step: window(start_step + profiler_step)


def process_memory_mib() -> dict[str, float | None]:
    """This process's resident memory now and its peak so far, in MiB (now is None where /proc is missing)."""
    try:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        kib = {name: int(status[name].split()[0]) for name in ("VmRSS", "VmHWM")}
        # One read for both keeps the peak at or above the current value.
        return {"rss_mib": kib["VmRSS"] / 1024, "peak_rss_mib": kib["VmHWM"] / 1024}
    except (OSError, KeyError, ValueError):
        return {"rss_mib": None, "peak_rss_mib": peak_memory_gib(torch.device("cpu")) * 1024}


class StepProfiler:
    """Context manager around the training loop; call `step(n)` after training step n."""

    def __init__(self, config: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int):
        self.config = config
        self.rank = rank
        self.step_num = start_step
        self.trace_dir = Path(dump_folder, config.save_traces_folder)
        self.memory_dir = Path(dump_folder, config.save_memory_snapshot_folder)
        self.cuda = device.type == "cuda"
        cpu_memory = config.enable_memory_snapshot and not self.cuda
        self.profiler = None
        if config.enable_profiling or cpu_memory:
            self.profiler = torch.profiler.profile(
                activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])],
                schedule=trace_schedule(config.profile_freq, start_step),
                on_trace_ready=self._on_trace_ready,
                record_shapes=config.enable_profiling,
                profile_memory=cpu_memory,
            )
        self.rss_log = None
        if cpu_memory:
            self.memory_dir.mkdir(parents=True, exist_ok=True)
            self.rss_log = open(self.memory_dir / f"rank{rank}_memory.jsonl", "a")

    def __enter__(self) -> StepProfiler:
        if self.profiler is not None:
            self.profiler.start()
            logger.info(f"profiling every {self.config.profile_freq} steps into {self.trace_dir}")
        if self.config.enable_memory_snapshot:
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            logger.info(f"memory snapshots every {self.config.profile_freq} steps into {self.memory_dir}")
        return self

    def step(self, step: int) -> None:
        self.step_num = step
        if self.rss_log is not None:
            self.rss_log.write(json.dumps({"step": step, **process_memory_mib()}) + "\n")
            self.rss_log.flush()
        if self.cuda and self.config.enable_memory_snapshot and step % self.config.profile_freq == 0:
            self._dump_cuda_snapshot(f"iteration_{step}")
        if self.profiler is not None:
            self.profiler.step()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.cuda and self.config.enable_memory_snapshot:
            if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
                self._dump_cuda_snapshot(f"iteration_{self.step_num + 1}_oom")
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.profiler is not None:
            # A window cut short by the end of training is dropped rather than written as a partial trace.
            self.profiler.on_trace_ready = None
            self.profiler.stop()
        if self.rss_log is not None:
            self.rss_log.close()

    def _dump_cuda_snapshot(self, name: str) -> None:
        folder = self.memory_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"memory snapshot written to {folder}")

    def _on_trace_ready(self, profiler: torch.profiler.profile) -> None:
        step = self.step_num
        if self.config.enable_profiling:
            folder = self.trace_dir / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        if self.rss_log is not None:
            folder = self.memory_dir / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            table = profiler.key_averages().table(sort_by="cpu_memory_usage", row_limit=MEMORY_OPS_ROWS)
            (folder / f"rank{self.rank}_memory_ops.txt").write_text(table + "\n")
