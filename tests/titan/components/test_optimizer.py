"""The optimizer as configured, and the lr schedule against torch's own schedulers.

The schedule is TorchTitan's warmup-stable-decay: the lr of step s+1 follows s completed steps, so after the
warmup our factor at scheduler epoch e is torch's at epoch e + 1 (one step later).
"""

import math

import pytest
import torch

from titan.components.optimizer import build_lr_scheduler, build_optimizer
from titan.config.job_config import LRScheduler, Optimizer


def _lrs(sched_config: LRScheduler, total: int, lr: float = 1.0) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_lr_scheduler(opt, sched_config, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _torch_lrs(make, total: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt)
    out = []
    for _ in range(total + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_decay_is_torchs_cosine_annealing_one_step_ahead():
    ours = _lrs(LRScheduler(warmup_steps=0, decay_type="cosine", min_lr_factor=0.1), 12)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12, eta_min=0.1), 12)
    assert ours == pytest.approx(ref[1:], abs=1e-12)


def test_linear_decay_is_torchs_linear_lr_one_step_ahead():
    ours = _lrs(LRScheduler(warmup_steps=0, decay_type="linear"), 10)
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=10), 10)
    assert ours == pytest.approx(ref[1:], abs=1e-12)


def test_warmup_then_stable_then_decay_over_the_last_fraction():
    lrs = _lrs(LRScheduler(warmup_steps=3, decay_ratio=0.5, decay_type="sqrt"), 11)
    assert lrs[:3] == pytest.approx([1 / 4, 2 / 4, 3 / 4])  # (s + 1) / (warmup + 1), as TorchTitan
    assert lrs[3:7] == [1.0] * 4  # 8 steps after warmup, half of them stable
    assert lrs[7:] == pytest.approx([1 - math.sqrt(p / 4) for p in (1, 2, 3, 4)])


@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam),
                                       ("SGD", torch.optim.SGD)])
def test_the_optimizer_gets_the_configured_hyperparameters(name, cls):
    cfg = Optimizer(name=name, lr=3e-4, weight_decay=0.05, implementation="for-loop")
    model = torch.nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    opt = build_optimizer(model, cfg)
    group = opt.param_groups[0]
    assert type(opt) is cls and group["lr"] == 3e-4 and group["weight_decay"] == 0.05
    assert [p.shape for p in group["params"]] == [model.weight.shape], "frozen parameters are left out"
    if name != "SGD":
        assert group["betas"] == (cfg.beta1, cfg.beta2) and group["eps"] == cfg.eps
