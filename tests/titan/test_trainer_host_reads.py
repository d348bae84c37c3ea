"""A training step never waits for the device: the host reads the loss, gradient norm, stop flags and the
non-finite state only on logged (or checkpointed) steps, once, and the non-finite policy acts on the device."""

import pytest
import torch

from tests.titan.conftest import TINY
from titan.config import parse_args
from titan.trainer import Trainer

# Every way a tensor's value reaches Python (on CUDA each waits for the stream).
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def reads_per_step(monkeypatch, tmp_path, *args, fault=""):
    """Trains 6 steps logging every 3rd; returns the host reads made from the start of each step to the next, and
    the model's parameters after each step."""
    monkeypatch.setenv("TITAN_FAULT", fault)
    cfg = parse_args([*TINY, "--training.steps", "6", "--metrics.log_freq", "3", "--metrics.enable_jsonl", "false",
                      "--job.dump_folder", str(tmp_path), *args])
    trainer = Trainer(cfg)
    count, per_step, params = [0], [], []

    def counted(read):
        def wrapper(self, *a, **k):
            count[0] += 1
            return read(self, *a, **k)
        return wrapper

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    train_step = trainer.train_step

    def step(data_iter):
        if trainer.step:
            per_step.append(count[0])
            params.append([p.detach().clone() for p in trainer.model.parameters()])
        count[0] = 0
        return train_step(data_iter)

    monkeypatch.setattr(trainer, "train_step", step)
    try:
        trainer.train()
    finally:
        monkeypatch.undo()
        trainer.close()
    return per_step, params, trainer


def test_no_host_read_between_logged_steps(monkeypatch, tmp_path):
    per_step, _, trainer = reads_per_step(monkeypatch, tmp_path)
    assert [r["step"] for r in trainer.history] == [1, 3, 6]
    # steps 1..5 (the last one's count ends with the run): one read on the logged steps 1 and 3, none between
    assert per_step == [1, 0, 1, 0, 0]


def test_a_skipped_update_is_dropped_on_the_device_and_reported_at_the_next_read(monkeypatch, tmp_path, caplog):
    per_step, params, trainer = reads_per_step(monkeypatch, tmp_path, "--training.on_nonfinite", "skip",
                                               fault="0:4:nan")
    assert per_step == [1, 0, 1, 0, 0]
    for before, after in zip(params[2], params[3]):  # after step 3, after the NaN step 4
        assert torch.equal(before, after)
    assert not all(torch.equal(a, b) for a, b in zip(params[3], params[4])), "step 5 updates again"
    assert "step 4: non-finite loss or grad norm; update skipped" in caplog.text
    state = trainer.optimizers[0].state[next(trainer.model.parameters())]
    assert state["step"].item() == 5, "AdamW counted the 5 applied updates of 6 steps"


def test_stop_raises_at_the_next_read_naming_the_first_nonfinite_step(monkeypatch, tmp_path):
    from titan.components.nonfinite import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match="non-finite loss or grad norm at step 4;"):
        reads_per_step(monkeypatch, tmp_path, fault="0:4:nan")
