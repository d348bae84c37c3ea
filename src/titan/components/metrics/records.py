"""The per-step record that goes to metrics.jsonl, tensorboard and the console."""

from __future__ import annotations

import time
from typing import Any

import torch

from titan.components.metrics.throughput import peak_memory_gib


class ThroughputWindow:
    """Tokens and seconds since the last logged step, turned into tps / TFLOP/s / MFU when a step is logged."""

    def __init__(self, flops_per_token: float, peak_tflops: float | None, device: torch.device):
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.device = device
        self.restart()

    def restart(self) -> None:
        """Starts a new window, e.g. after a checkpoint save that should not count as training time."""
        self.start, self.tokens, self.steps = time.perf_counter(), 0, 0

    def add_step(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def record(self, step: int, out: dict[str, Any], lr: float, elapsed_s: float,
               steps_left: int) -> tuple[dict[str, Any], float]:
        """The record of `step` from the train step's output `out`, and the ETA in seconds; restarts the window."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        tps = self.tokens / seconds
        tflops = self.flops_per_token * tps / 1e12
        record = {
            "step": step,
            "loss": out["loss"],
            "grad_norm": out["grad_norm"],
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "mfu": 100.0 * tflops / self.peak_tflops if self.peak_tflops else None,
            "memory_gib": peak_memory_gib(self.device),
            "elapsed_s": elapsed_s,
            **{k: v for k, v in out.items() if k not in ("loss", "grad_norm", "tokens")},
        }
        eta = steps_left * seconds / max(self.steps, 1)
        self.restart()
        return record, eta
