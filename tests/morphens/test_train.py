"""Training and scoring one net: the warmup-then-cosine schedule, accuracies by hand, a local fit that trains a
copy and counts its steps and FLOPs, seeded initialization, and predictions in eval mode."""

import math

import pytest
import torch

from morphens.arch import MLP, forward_flops
from morphens.config import load_config
from morphens.data import load
from morphens.train import accuracy, ensemble_accuracy, fit, lr_factor, predict, seeded, steps_for


def test_lr_rises_linearly_over_5_percent_then_falls_as_a_cosine_to_zero():
    # 105 steps: warmup over 5, then cosine over 100.
    assert [lr_factor(s, 105) for s in (0, 2, 4)] == pytest.approx([0.2, 0.6, 1.0])
    assert [lr_factor(s, 105) for s in (5, 55, 104)] == pytest.approx([1.0, 0.5, 0.5 * (1 + math.cos(0.99 * math.pi))])


def test_accuracy_is_percent_correct_and_the_ensemble_averages_the_softmax():
    labels = torch.tensor([0, 1, 1])
    sure = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.2, 0.8]])  # right on 0 and 2
    unsure = torch.tensor([[0.4, 0.6], [0.4, 0.6], [0.4, 0.6]])  # right on 1 and 2
    assert accuracy(sure, labels) == pytest.approx(200 / 3) and accuracy(unsure, labels) == pytest.approx(200 / 3)
    # Averaged: [0.65, 0.35], [0.65, 0.35], [0.3, 0.7]: on sample 1 the confident wrong member outweighs the other.
    assert ensemble_accuracy([sure, unsure], labels) == pytest.approx(200 / 3)
    # Averaged: [0.75, 0.25], [0.475, 0.525], [0.3, 0.7]: a more confident right member outweighs it.
    assert ensemble_accuracy([sure, torch.tensor([[0.6, 0.4], [0.05, 0.95], [0.4, 0.6]])], labels) == 100.0


@pytest.fixture(scope="module")
def digits():
    cfg = load_config("", [("data.dataset", "digits"), ("training.engine", "local"), ("training.batch_size", "64"),
                           ("data.train_limit", "256")])
    return cfg, load("digits")


def test_a_local_fit_trains_a_copy_and_counts_steps_and_flops(digits):
    cfg, data = digits
    arch = MLP(data.in_shape, 10, (16,))
    net = seeded(arch, 0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    result = fit(net, data, cfg, epochs=1.5, lr=3e-3, seed=0, name="m")
    assert result.steps == steps_for(1.5, data, cfg) == math.ceil(1.5 * 256 // 64)  # 4 batches of 64 per epoch
    assert result.flops == 3.0 * forward_flops(arch) * result.steps * 64
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert not torch.equal(result.net.state_dict()["head.weight"], before["head.weight"])


def test_seeded_nets_depend_only_on_the_seed():
    arch = MLP((1, 8, 8), 10, (16,))
    same, other = seeded(arch, 3).state_dict(), seeded(arch, 4).state_dict()
    assert all(torch.equal(v, seeded(arch, 3).state_dict()[k]) for k, v in same.items())
    assert not torch.equal(same["head.weight"], other["head.weight"])


def test_predictions_are_probabilities_of_the_test_split_in_eval_mode(digits):
    _, data = digits
    net = seeded(MLP(data.in_shape, 10, (16,)), 0).train()
    probs = predict(net, data, limit=100)
    assert probs.shape == (100, 10) and torch.allclose(probs.sum(-1), torch.ones(100))
    assert net.training  # its mode is given back
    torch.testing.assert_close(predict(net, data, limit=100), probs)  # eval mode: BatchNorm statistics not updated
