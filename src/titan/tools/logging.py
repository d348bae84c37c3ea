"""Rank-aware logger: rank 0 prints, the others only warnings and errors."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("titan")


class _CurrentStdout(logging.StreamHandler):
    """Writes to sys.stdout as it is now, not as it was when the logger was set up (a redirect or a test
    harness replaces it; the old stream may be closed)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def init_logger() -> None:
    # Idempotent on our own handler only: one a user (or a test harness) attached to "titan" keeps its output
    # and does not take the console's away.
    if any(isinstance(h, _CurrentStdout) for h in logger.handlers):
        return
    rank = int(os.environ.get("RANK", "0"))
    handler = _CurrentStdout()
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
