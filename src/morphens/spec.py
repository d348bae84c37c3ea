"""The `morphnet` ModelSpec: titan trains any member or mother (VGG / ResNet / MLP spec as model args).

From titan's own command line: `python -m titan.train --model.spec morphens.spec --model.name morphnet
--model.flavor digits_vgg --training.dataset digits`. `training.dataset` names the image set and may carry
options as a query string, e.g. `fashion_mnist?train_limit=10000&augment=false` (what `morphens.run` passes).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode

import torch

from morphens.arch import MLP, VGG, Conv, ResNet, Stage, forward_flops
from morphens.config import RunConfig
from morphens.data import Loader, load
from morphens.models import Net
from titan.distributed import apply_data_parallel
from titan.models import register_model_spec
from titan.protocols.model_spec import ModelSpec

FLAVORS = {
    "digits_vgg": VGG((1, 8, 8), 10, ((Conv(16), Conv(16, 5)), (Conv(32),))),
    "digits_mlp": MLP((1, 8, 8), 10, (128, 64)),
    "fashion_vgg": VGG((1, 28, 28), 10, ((Conv(16), Conv(16, 5)), (Conv(32), Conv(32)), (Conv(64),))),
    "cifar_resnet": ResNet((3, 32, 32), 10, (Stage(32, (32,)), Stage(64, (64,)), Stage(128, (128,)))),
}
DATA_OPTIONS = {"train_limit": int, "test_limit": int, "bootstrap": int,
                "augment": lambda v: v.lower() in ("1", "true")}


def dataset_uri(cfg: RunConfig) -> str:
    """`training.dataset` for titan: the dataset name with this run's data options."""
    d = cfg.data
    return f"{d.dataset}?" + urlencode({"train_limit": d.train_limit, "test_limit": d.test_limit,
                                        "bootstrap": d.bootstrap, "augment": str(d.augment).lower()})


def parse_dataset_uri(uri: str) -> tuple[str, dict]:
    name, _, query = uri.partition("?")
    options = {}
    for key, value in parse_qsl(query):
        if key not in DATA_OPTIONS:
            raise ValueError(f"training.dataset: unknown option {key!r} in {uri!r}; known: {', '.join(DATA_OPTIONS)}")
        options[key] = DATA_OPTIONS[key](value)
    return name, options


def build_dataloader(job_config, dp_rank: int, dp_degree: int, tokenizer=None, split: str = "train") -> Loader:
    name, options = parse_dataset_uri(job_config.training.dataset)
    data = load(name, job_config.training.dataset_path)
    limit = options.get("train_limit" if split == "train" else "test_limit", 0)
    return Loader(data, job_config.training.local_batch_size, split=split, augmented=options.get("augment", True),
                  seed=job_config.debug.seed, rank=dp_rank, world=dp_degree, limit=limit,
                  bootstrap=options.get("bootstrap", 0))


def accuracy(pred: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (pred.argmax(-1) == labels).float().mean()}


SPEC = register_model_spec(ModelSpec(
    name="morphnet",
    flavors=FLAVORS,
    build_model=Net,
    parallelize=apply_data_parallel,
    build_dataloader=build_dataloader,
    metrics_fn=accuracy,
    flops_per_token=lambda model, arch, seq_len: 3.0 * forward_flops(arch),  # a "token" is one image
))


def train_with_titan(net: Net, cfg: RunConfig, steps: int, lr: float, seed: int, name: str,
                     solo: bool = False) -> Net:
    """Trains a copy of `net` with titan's Trainer (starting from its weights) and returns the trained copy;
    `solo` trains it on this rank alone (titan's BuildInputs.solo)."""
    from titan.builders import BuildInputs
    from titan.config import JobConfig
    from titan.distributed.runtime import world_size_from_env
    from titan.trainer import Trainer

    job = JobConfig()
    job.job.name, job.job.dump_folder = name, str(Path(cfg.run.out) / "nets" / name)
    job.model.name, job.model.spec = SPEC.name, __name__
    t = cfg.training
    job.training.steps, job.training.global_batch_size = steps, t.batch_size
    job.training.seq_len = 1  # one label per image; the default 256 only showed up, wrongly, in titan's log line
    job.training.local_batch_size = t.batch_size if solo else max(t.batch_size // world_size_from_env(), 1)
    job.training.dataset, job.training.dataset_path = dataset_uri(cfg), cfg.data.path
    job.training.mixed_precision_param = "float32"  # small convs gain nothing from bf16 on CPU
    job.optimizer.lr, job.optimizer.weight_decay = lr, t.weight_decay
    job.lr_scheduler.warmup_steps = max(int(0.05 * steps), 1)
    job.lr_scheduler.decay_type, job.lr_scheduler.min_lr_factor = "cosine", 0.0
    job.metrics.log_freq, job.metrics.enable_tensorboard = max(steps // 4, 1), False
    job.debug.seed, job.debug.threads = seed, t.threads
    trainer = Trainer(job, BuildInputs(model_spec=SPEC, model_args=net.arch, initial_state_dict=net.state_dict(),
                                       solo=solo))
    trainer.train()
    out = Net(net.arch)
    out.load_state_dict(trainer.full_state_dict())
    return out.eval()
