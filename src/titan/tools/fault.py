"""Fault injection for testing recovery: `TITAN_FAULT=RANK:STEP:POINT[,...]` in the environment.

POINT is `step` (SIGKILL before training step STEP), `save` (SIGKILL after the checkpoint of step STEP was
written but before it was committed) or `nan` (make the loss of step STEP NaN). Faults fire only in the
first attempt of an elastic job, so a restarted worker group runs through.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from titan.tools.cli import UserError
from titan.tools.logging import logger

POINTS = ("step", "save", "nan")


def _faults() -> list[tuple[int, int, str]]:
    spec = os.environ.get("TITAN_FAULT", "")
    faults = []
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in POINTS:
            raise UserError(f"TITAN_FAULT item {item!r} must look like RANK:STEP:POINT with POINT in {POINTS}")
        faults.append((int(parts[0]), int(parts[1]), parts[2]))
    return faults


def check_faults() -> None:
    """Reports a malformed TITAN_FAULT before a run writes anything."""
    _faults()


def fault_point(point: str, step: int) -> bool:
    """Fires a configured fault here; returns True for a `nan` fault (the caller poisons the loss)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (rank, step, point) not in _faults():
        return False
    if point == "nan":
        logger.warning(f"fault injection: NaN loss at step {step} on rank {rank}")
        return True
    where = f"before step {step}" if point == "step" else f"while saving the checkpoint of step {step}"
    logger.warning(f"fault injection: SIGKILL of rank {rank} {where}")
    os.kill(os.getpid(), signal.SIGKILL)
    return False
