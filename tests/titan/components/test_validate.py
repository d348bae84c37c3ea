"""Validation on one rank through the forward path training uses: the mean over `validation.steps` batches of the
loss and the spec's metrics, computed in eval mode without gradients and leaving the model in train mode; an empty
split is an error naming the fix."""

import pytest
import torch
from torch import nn

from titan.components.forward import ForwardPath
from titan.components.loss import cross_entropy_loss
from titan.components.validate import evaluate
from titan.config import parse_args
from titan.distributed import ParallelDims
from titan.tools.cli import UserError


class Lookup(nn.Module):
    """Logits that depend only on the token (a bigram table), with dropout to tell eval mode from train mode."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table, self.drop, self.modes = nn.Embedding(5, 5), nn.Dropout(0.9), []

    def forward(self, tokens):
        self.modes.append((self.training, torch.is_grad_enabled()))
        return self.drop(self.table(tokens))


def one_rank(metrics_fn=None):
    config = parse_args([])
    return ForwardPath([Lookup()], None, ParallelDims.from_config(config.parallelism, 1), config,
                       torch.device("cpu"), cross_entropy_loss, metrics_fn, 1, torch.float32)


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (2, 3), generator=gen), torch.randint(0, 5, (2, 3), generator=gen)


def test_the_mean_over_the_first_steps_batches_in_eval_mode():
    batches = [batch(i) for i in range(3)]
    forward = one_rank(metrics_fn=lambda pred, labels: {"acc": (pred.argmax(-1) == labels).float().mean()})
    result = evaluate(forward, iter(batches), steps=2)
    model = forward.parts[0]
    table = model.table
    expected = [cross_entropy_loss(table(x), y).item() for x, y in batches[:2]]
    accuracy = [(table(x).argmax(-1) == y).float().mean().item() for x, y in batches[:2]]
    assert result == pytest.approx({"loss": sum(expected) / 2, "acc": sum(accuracy) / 2}, rel=1e-6)
    assert model.modes == [(False, False), (False, False)] and model.training


def test_negative_steps_take_every_batch():
    batches = [batch(i) for i in range(3)]
    forward = one_rank()
    expected = sum(cross_entropy_loss(forward.parts[0].table(x), y).item() for x, y in batches) / 3
    assert evaluate(forward, iter(batches), steps=-1) == pytest.approx({"loss": expected}, rel=1e-6)


def test_an_empty_validation_split_names_the_fix():
    with pytest.raises(UserError, match="the validation split yielded no batch; lower training.local_batch_size"):
        evaluate(one_rank(), iter([]), steps=2)
