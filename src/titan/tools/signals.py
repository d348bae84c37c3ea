"""SIGINT / SIGTERM during training (Ctrl-C, a preempted SLURM job): finish the step, then stop on every rank.

Inside `StopSignals` the first signal only sets a flag. Each step's loss all-reduce carries the flags too (no
collective of its own) and the host reads them with the loss, on logged and checkpointed steps only (no host sync
between them), so the ranks agree: one rank's signal stops them all after the same such step, which writes a
checkpoint and raises Interrupted. A single process stops after the step under way.
A repeat within REPEAT_S of the first is the same signal delivered twice (by the terminal to the whole process
group and again by torchrun to its workers) and is ignored; a later one stops at once, for a step that hangs.
"""

from __future__ import annotations

import signal
import threading
import time

import torch

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
        self.signum = 0
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

    def flags(self, like: torch.Tensor) -> torch.Tensor:
        """One entry per kind of SIGNALS, non-zero for the one received, to be summed over the ranks."""
        flags = torch.zeros(len(SIGNALS), dtype=like.dtype, device=like.device)
        if self.signum:
            flags[SIGNALS.index(self.signum)] = 1  # a scalar fill: no host-to-device copy to wait for
        return flags

    def agreed(self, summed_flags: list[float]) -> int:
        """The signal that stops every rank after this step (this rank's, else any other's), or 0."""
        if self.signum:
            return self.signum
        others = [s for s, flag in zip(SIGNALS, summed_flags) if flag > 0]
        if others:
            logger.info(f"another rank got {others[0].name}: stopping with it")
        return others[0] if others else 0
