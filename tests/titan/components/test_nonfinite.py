"""A NaN/Inf step stops the run, or with on_nonfinite = "skip" drops a bounded number of updates in a row; the
guard tracks it on the device and the host learns of it at its next read."""

import pytest
import torch

from titan.components.nonfinite import NonFiniteGuard, NonFiniteLossError
from titan.config.job_config import Training

NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def run(guard, losses, first_step=1):
    """Observes one step per loss; returns each step's found_inf and the state the host would read last."""
    found = [guard.observe(step, loss, ONE).item() for step, loss in enumerate(losses, first_step)]
    return found, guard.state.tolist()


def test_stop_raises_at_the_first_nonfinite_step_with_the_fix_in_the_message():
    guard = NonFiniteGuard(Training(on_nonfinite="stop"), torch.device("cpu"))
    found, state = run(guard, [ONE, NAN, ONE])
    assert found == [0.0, 1.0, 0.0], "the non-finite step's update is masked even under stop"
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss or grad norm at step 2; nothing of it was "
                                                 r"checkpointed\. Lower optimizer.lr"):
        guard.check(state, 3, 1.0, 1.0)


def test_the_message_has_the_values_when_the_read_step_is_the_bad_one():
    guard = NonFiniteGuard(Training(on_nonfinite="stop"), torch.device("cpu"))
    _, state = run(guard, [NAN], first_step=7)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan / grad norm 1.0 at step 7;"):
        guard.check(state, 7, float("nan"), 1.0)


def test_skip_allows_max_consecutive_skips_in_a_row_and_a_finite_step_resets_the_count(caplog):
    guard = NonFiniteGuard(Training(on_nonfinite="skip", max_consecutive_skips=2), torch.device("cpu"))
    found, state = run(guard, [NAN, NAN, ONE, NAN])
    assert found == [1.0, 1.0, 0.0, 1.0]
    guard.check(state, 4, float("nan"), 1.0)
    assert "step 1: non-finite loss or grad norm; update skipped, 3 updates skipped up to step 4" in caplog.text
    assert guard.state.tolist() == [0, 1, 0, 0], "a check starts counting afresh; the run in a row goes on"
    _, state = run(guard, [NAN, NAN, ONE], first_step=5)
    with pytest.raises(NonFiniteLossError, match="at step 6 after 2 skipped steps"):
        guard.check(state, 7, 1.0, 1.0)
