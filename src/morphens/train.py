"""Training one net (mother, hatched or independent member) and scoring nets and ensembles.

Two engines share one recipe (AdamW, linear warmup over 5% of steps then cosine decay to zero, grad-norm clip 1):
`titan` trains through titan.trainer.Trainer with the `morphnet` ModelSpec (FSDP data parallel, checkpointing,
metrics.jsonl); `local` is a plain loop in this process, for machines without the engine and for fast tests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from morphens.arch import Arch, forward_flops
from morphens.config import RunConfig
from morphens.data import Dataset, Loader
from morphens.models import Net
from morphens.records import Seconds

WARMUP = 0.05


@dataclass
class Fit:
    net: Net
    """The trained net, on the CPU (hatching and the spread's broadcasts work there)."""
    steps: int
    time: Seconds
    flops: float
    """Training FLOPs: 3 x forward FLOPs per image x images seen."""


def steps_for(epochs: float, data: Dataset, cfg: RunConfig) -> int:
    loader = Loader(data, cfg.training.batch_size, limit=cfg.data.train_limit)
    return max(math.ceil(epochs * loader.steps_per_epoch), 1) if epochs else 0


def lr_factor(step: int, steps: int) -> float:
    warmup = max(int(WARMUP * steps), 1)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def fit(net: Net, data: Dataset, cfg: RunConfig, epochs: float, lr: float, seed: int, name: str,
        solo: bool = False) -> Fit:
    """Trains a copy of `net` (the argument stays as it was) for `epochs` epochs of the training split; `solo`
    trains it on this rank alone in a multi-rank job (the local engine always does)."""
    steps = steps_for(epochs, data, cfg)
    start, cpu_start = time.perf_counter(), time.process_time()
    if cfg.training.engine == "titan":
        from morphens.spec import train_with_titan

        trained = train_with_titan(net, cfg, steps, lr, seed, name, solo)
    else:
        trained = _train_local(net, data, cfg, steps, lr, seed)
    seconds = Seconds(time.perf_counter() - start, time.process_time() - cpu_start)
    flops = 3.0 * forward_flops(net.arch) * steps * cfg.training.batch_size
    return Fit(trained.cpu(), steps, seconds, flops)


def _train_local(net: Net, data: Dataset, cfg: RunConfig, steps: int, lr: float, seed: int) -> Net:
    t = cfg.training
    device = t.torch_device()
    model = Net(net.arch)
    model.load_state_dict(net.state_dict())
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    batches = iter(Loader(data, t.batch_size, augmented=cfg.data.augment, seed=seed, limit=cfg.data.train_limit,
                          bootstrap=cfg.data.bootstrap))
    for _ in range(steps):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.eval()


@torch.no_grad()
def predict(net: Net, data: Dataset, limit: int = 0, device: torch.device | None = None,
            batch_size: int = 1000) -> torch.Tensor:
    """Softmax probabilities on the test split, (N, classes), in eval mode, computed on `device` (default the
    net's); returned on the CPU, the net left where it was."""
    was_training, home = net.training, next(net.parameters()).device
    device = device or home
    net.to(device).eval()
    probs = torch.cat([F.softmax(net(x.to(device, non_blocking=True)), -1).cpu()
                       for x, _ in Loader(data, batch_size, split="test", limit=limit)])
    net.to(home).train(was_training)
    return probs


def eval_labels(data: Dataset, limit: int = 0) -> torch.Tensor:
    return torch.cat([y for _, y in Loader(data, 1000, split="test", limit=limit)])


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Percent correct."""
    return 100.0 * float((probs.argmax(-1) == labels).float().mean())


def ensemble_accuracy(probs: list[torch.Tensor], labels: torch.Tensor) -> float:
    """Accuracy of the averaged softmax of the members."""
    return accuracy(torch.stack(probs).mean(0), labels)


def seeded(arch: Arch, seed: int) -> Net:
    """A freshly initialized net whose weights depend only on `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = Net(arch)
        net.init_weights()
    return net
