"""SIGINT / SIGTERM during training (Ctrl-C, a preempted SLURM job): finish the step, then stop on every rank.

Inside `StopSignals` the first signal only sets a flag; the loop asks `requested()` after each step, which the
ranks agree on (one rank's signal stops them all at the same step), writes a checkpoint and raises Interrupted.
A repeat within REPEAT_S of the first is the same signal delivered twice (by the terminal to the whole process
group and again by torchrun to its workers) and is ignored; a later one stops at once, for a step that hangs.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from titan.tools.cli import Interrupted
from titan.tools.logging import logger

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 2.0


class StopSignals:
    def __init__(self):
        self.signum = 0
        self._first = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first = signum, now
        elif now - self._first > REPEAT_S:
            raise Interrupted(signum, "a second signal stopped the step under way; no checkpoint of it")

    def requested(self, device: torch.device, collective: bool) -> int:
        """The signal that asks to stop (on any rank, when `collective`), or 0."""
        if not collective:
            return self.signum
        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.signum:
            logger.info(f"another rank got {signal.Signals(int(flag.item())).name}: stopping with it")
        return int(flag.item())
