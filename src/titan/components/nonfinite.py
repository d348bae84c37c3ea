"""What a NaN/Inf loss or gradient norm does: stop the run, or skip the update a bounded number of times."""

from __future__ import annotations

from titan.tools.cli import UserError
from titan.tools.logging import logger


class NonFiniteLossError(UserError):
    """Training produced a NaN/Inf loss or gradient norm."""


class NonFiniteGuard:
    """`training.on_nonfinite`: "stop" raises at once; "skip" drops the update, at most
    `training.max_consecutive_skips` times in a row. Either way nothing of the step reaches a checkpoint."""

    def __init__(self, training):
        self.policy = training.on_nonfinite
        self.max_skips = training.max_consecutive_skips
        self.consecutive_skips = 0

    def finite_step(self) -> None:
        self.consecutive_skips = 0

    def nonfinite_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Returns when the update is to be skipped; raises NonFiniteLossError when the run must stop."""
        self.consecutive_skips += 1
        if self.policy == "skip" and self.consecutive_skips <= self.max_skips:
            logger.warning(f"step {step}: non-finite loss {loss} / grad norm {grad_norm}; update skipped "
                           f"({self.consecutive_skips} in a row, at most {self.max_skips})")
            return
        skipped = self.consecutive_skips - 1
        raise NonFiniteLossError(
            f"non-finite loss {loss} / grad norm {grad_norm} at step {step}"
            f"{' after ' + str(skipped) + ' skipped steps' if skipped else ''}"
            "; nothing of it was checkpointed. Lower optimizer.lr, raise lr_scheduler.warmup_steps, "
            "set training.max_norm, or resume from the last checkpoint"
        )
