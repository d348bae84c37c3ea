"""Rank-aware logger: rank 0 prints, the others only warnings and errors."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("titan")


def init_logger() -> None:
    if logger.handlers:
        return
    rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
