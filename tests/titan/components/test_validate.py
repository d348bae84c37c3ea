"""Validation on one rank: the mean over `validation.steps` batches of the loss and the spec's metrics, computed in
eval mode without gradients and leaving the model in train mode; an empty split is an error naming the fix."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from titan.components.loss import cross_entropy_loss
from titan.components.validate import evaluate
from titan.tools.cli import UserError

ONE_RANK = SimpleNamespace(cp_enabled=False, tp_enabled=False, world_size=1, pp=1, dp_degree=1)


class Lookup(nn.Module):
    """Logits that depend only on the token (a bigram table), with dropout to tell eval mode from train mode."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table, self.drop, self.modes = nn.Embedding(5, 5), nn.Dropout(0.9), []

    def forward(self, tokens):
        self.modes.append((self.training, torch.is_grad_enabled()))
        return self.drop(self.table(tokens))


def trainer(batches, steps, metrics_fn=None):
    model = Lookup()
    spec = SimpleNamespace(build_dataloader=lambda *args: iter(batches), metrics_fn=metrics_fn)
    return SimpleNamespace(spec=spec, config=SimpleNamespace(validation=SimpleNamespace(steps=steps),
                                                             parallelism=SimpleNamespace(enable_loss_parallel=False)),
                           dp_rank=0, parallel_dims=ONE_RANK, tokenizer=None, model_parts=[model], model=model,
                           loss_fn=cross_entropy_loss, device=torch.device("cpu"), sharded=False,
                           autocast_dtype=torch.float32, pp_schedule=None)


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (2, 3), generator=gen), torch.randint(0, 5, (2, 3), generator=gen)


def test_the_mean_over_the_first_steps_batches_in_eval_mode():
    batches = [batch(i) for i in range(3)]
    run = trainer(batches, steps=2, metrics_fn=lambda pred, labels: {"acc": (pred.argmax(-1) == labels).float().mean()})
    result = evaluate(run)
    table = run.model.table
    expected = [cross_entropy_loss(table(x), y).item() for x, y in batches[:2]]
    accuracy = [(table(x).argmax(-1) == y).float().mean().item() for x, y in batches[:2]]
    assert result == pytest.approx({"loss": sum(expected) / 2, "acc": sum(accuracy) / 2}, rel=1e-6)
    assert run.model.modes == [(False, False), (False, False)] and run.model.training


def test_negative_steps_take_every_batch():
    batches = [batch(i) for i in range(3)]
    run = trainer(batches, steps=-1)
    expected = sum(cross_entropy_loss(run.model.table(x), y).item() for x, y in batches) / 3
    assert evaluate(run) == pytest.approx({"loss": expected}, rel=1e-6)


def test_an_empty_validation_split_names_the_fix():
    with pytest.raises(UserError, match="the validation split yielded no batch; lower training.local_batch_size"):
        evaluate(trainer([], steps=2))
