"""TITAN_FAULT: RANK:STEP:POINT items fire once, at that rank and step, in the first attempt only."""

import signal

import pytest

from titan.tools import fault
from titan.tools.cli import UserError


@pytest.fixture
def faults(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    kills = []
    monkeypatch.setattr(fault.os, "kill", lambda pid, sig: kills.append(sig))
    return lambda spec: monkeypatch.setenv("TITAN_FAULT", spec) or kills


def test_a_nan_fault_fires_only_at_its_rank_and_step(faults):
    kills = faults("1:2:nan,0:3:nan")
    assert [fault.fault_point("nan", step) for step in (1, 2, 3, 4)] == [False, False, True, False]
    assert kills == []


def test_a_step_fault_kills_the_process_with_sigkill(faults):
    kills = faults("0:2:step")
    assert not fault.fault_point("save", 2) and kills == []
    fault.fault_point("step", 2)
    assert kills == [signal.SIGKILL]


def test_a_restarted_worker_group_runs_through(faults, monkeypatch):
    kills = faults("0:2:step,0:2:nan")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not fault.fault_point("nan", 2) and not fault.fault_point("step", 2) and kills == []


@pytest.mark.parametrize("item", ["0:3:explode", "0:3", "a:3:nan", "0:-1:step"])
def test_a_malformed_item_is_named_in_the_error(faults, item):
    faults(f"0:1:nan,{item}")
    with pytest.raises(UserError, match=f"TITAN_FAULT item '{item}' must look like RANK:STEP:POINT"):
        fault.check_faults()
