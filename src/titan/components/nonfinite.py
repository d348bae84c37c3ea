"""What a NaN/Inf loss or gradient norm does: stop the run, or skip the update a bounded number of times.

The check runs on the device every step and the host learns of it only when it reads the step's values (once
per logged or checkpointed step), so a step never waits for the device. With a fused optimizer (the default) a
non-finite step's update is dropped by the optimizer kernel itself, through its `found_inf` input as GradScaler
uses it; another optimizer implementation under "skip" reads one flag per step instead.
"""

from __future__ import annotations

import torch

from titan.tools.cli import UserError
from titan.tools.logging import logger


class NonFiniteLossError(UserError):
    """Training produced a NaN/Inf loss or gradient norm."""


# Entries of NonFiniteGuard.state.
COUNT, RUN, FIRST, OVER = range(4)


class NonFiniteGuard:
    """`training.on_nonfinite`: "stop" raises at the first non-finite step; "skip" drops the update, at most
    `training.max_consecutive_skips` times in a row. Either way nothing of the step reaches a checkpoint: the
    trainer reads the state (`check`) before every save."""

    def __init__(self, training, device: torch.device):
        self.policy = training.on_nonfinite
        self.max_skips = training.max_consecutive_skips if self.policy == "skip" else 0
        # Since the last check: non-finite steps, the first of them, the first beyond max_skips in a row; and
        # the current run of non-finite steps in a row (which goes on across checks).
        self.state = torch.zeros(4, dtype=torch.int64, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Records on the device whether `step` was finite; returns its `found_inf` (1.0: drop the update)."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        s = self.state
        s[RUN] = (s[RUN] + 1) * bad
        s[COUNT] += bad
        s[FIRST] = torch.where((s[FIRST] == 0) & bad, step, s[FIRST])
        s[OVER] = torch.where((s[OVER] == 0) & (s[RUN] > self.max_skips), step, s[OVER])
        return bad.float()

    def mask_update(self, optimizers: list[torch.optim.Optimizer], found_inf: torch.Tensor) -> bool:
        """Hands `found_inf` to fused optimizers, which skip the update on the device; returns whether the host
        must step them (False only for a non-fused optimizer under "skip" on a non-finite step: a host read)."""
        fused = all(opt.defaults.get("fused") for opt in optimizers)
        if fused:
            for opt in optimizers:
                opt.found_inf = found_inf
            return True
        return self.policy == "stop" or not bool(found_inf)

    def check(self, state: list[float], step: int, loss: float, grad_norm: float) -> None:
        """On the host, with `state` read at `step`: warns of skipped updates, raises NonFiniteLossError when the
        run must stop, then starts counting afresh."""
        count, first, over = int(state[COUNT]), int(state[FIRST]), int(state[OVER])
        for i in (COUNT, FIRST, OVER):
            self.state[i] = 0
        values = f"loss {loss} / grad norm {grad_norm}" if step in (first, over) else "loss or grad norm"
        if over:
            skipped = f" after {self.max_skips} skipped steps" if self.max_skips else ""
            raise NonFiniteLossError(
                f"non-finite {values} at step {over}{skipped}; nothing of it was checkpointed. Lower optimizer.lr, "
                "raise lr_scheduler.warmup_steps, set training.max_norm, or resume from the last checkpoint"
            )
        if count:
            upto = f", {count} updates skipped up to step {step}" if count > 1 else ""
            logger.warning(f"step {first}: non-finite {values}; update skipped{upto} (at most {self.max_skips} in "
                           "a row)")
