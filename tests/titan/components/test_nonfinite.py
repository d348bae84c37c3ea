"""A NaN/Inf step stops the run, or with on_nonfinite = "skip" drops a bounded number of updates in a row."""

import pytest

from titan.components.nonfinite import NonFiniteGuard, NonFiniteLossError
from titan.config.job_config import Training


def test_stop_raises_at_the_first_nonfinite_step_with_the_fix_in_the_message():
    guard = NonFiniteGuard(Training(on_nonfinite="stop"))
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan / grad norm 1.0 at step 7; nothing of it was "
                                                 r"checkpointed\. Lower optimizer.lr"):
        guard.nonfinite_step(7, float("nan"), 1.0)


def test_skip_allows_max_consecutive_skips_in_a_row_and_a_finite_step_resets_the_count():
    guard = NonFiniteGuard(Training(on_nonfinite="skip", max_consecutive_skips=2))
    guard.nonfinite_step(1, float("inf"), 1.0)
    guard.nonfinite_step(2, float("inf"), 1.0)
    guard.finite_step()
    guard.nonfinite_step(4, float("inf"), 1.0)
    guard.nonfinite_step(5, float("inf"), 1.0)
    with pytest.raises(NonFiniteLossError, match="at step 6 after 2 skipped steps"):
        guard.nonfinite_step(6, float("inf"), 1.0)
