"""Run configuration: typed sections from defaults, then a TOML or JSON file, then `--section.key value`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from morphens.arch import Generator
from morphens.data import DATASETS
from titan.config.manager import ConfigManager


@dataclass
class Data:
    dataset: str = "fashion_mnist"
    """One of digits, fashion_mnist, cifar10, cifar100, svhn."""
    path: str = ""
    """Where the files are ("" = the dataset's usual place: Debian's for Fashion-MNIST, ./data for torchvision)."""
    download: bool = False
    """Let torchvision download CIFAR/SVHN when the files are missing (needs internet)."""
    train_limit: int = 10000
    """Train on a fixed random subset of this many images (0 = all)."""
    test_limit: int = 0
    """Evaluate on a fixed random subset of this many test images (0 = all)."""
    augment: bool = True
    """Standard augmentation: random shifts, plus horizontal flips where they keep the label."""
    bootstrap: int = 0
    """Train on a resample, with replacement, of the training subset drawn with this seed (0 = the subset itself)."""

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"data.dataset: unknown {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        if self.train_limit < 0 or self.test_limit < 0 or self.bootstrap < 0:
            raise ValueError("data.train_limit, data.test_limit and data.bootstrap must be >= 0 "
                             "(0 = all images, no resample)")


@dataclass
class Ensemble:
    size: int = 4
    """Members K drawn from the generator (ignored when `members` is given)."""
    family: str = "vgg"
    """Generator family: vgg, resnet, mlp or mixed."""
    blocks: int = 3
    """Pooling levels (VGG blocks / ResNet stages) of generated members."""
    width: int = 6
    """Base width of generated members (block b draws from width * 2**b * [1, spread])."""
    spread: float = 1.5
    """Largest over smallest width a generated layer may draw."""
    max_depth: int = 2
    """Most layers per block of generated members."""
    kernels: list[int] = field(default_factory=lambda: [3, 5])
    """VGG kernel sizes to draw from."""
    seed: int = 0
    """Seed of the generator (members differ by architecture and by initialization)."""
    members: list[dict] = field(default_factory=list)
    """Explicit members, e.g. [{family = "vgg", blocks = [[[16, 3]], [[32, 5]]]}] (TOML only); overrides size."""

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"ensemble.size must be >= 1, got {self.size}")
        if any(not isinstance(m, dict) for m in self.members):
            raise ValueError("ensemble.members must be a list of tables like {family = \"mlp\", hidden = [128]}")
        try:
            self.generator()
        except ValueError as e:
            raise ValueError(f"ensemble: {e}") from None

    def generator(self) -> Generator:
        return Generator(self.family, self.blocks, self.width, self.spread, self.max_depth, tuple(self.kernels))


@dataclass
class MotherNet:
    clusters: int = 1
    """g: number of clusters, each with its own mother (1 = cheapest, K = independent training)."""
    members_per_cluster: int = 0
    """When > 0, g = ceil(K / members_per_cluster) at every ensemble size K of a sweep (overrides clusters)."""
    mother_epochs: float = 24.0
    """Epochs of mother training: long, since a small mother is cheap and its accuracy bounds the members'."""
    hatch_epochs: float = 2.0
    """Epochs of each hatched member after hatching."""
    hatch_lr_factor: float = 1.0
    """Peak learning rate of hatched members relative to training.lr (they start from a trained function)."""
    hatch_batch_size: int = 0
    """Batch size of hatched members' training (0 = training.batch_size): fewer, larger steps where a step's fixed
    cost dominates (tiny images)."""
    noise: float = 0.01
    """Symmetry-breaking noise: relative RMS change of the hatched member's logits on a calibration batch."""
    calib_batch: int = 512
    """Images used to calibrate new BatchNorm layers and to size the noise."""
    snapshots: int = 1
    """Snapshot mothers per cluster (at most its member count): after mother_epochs the mother trains snapshots - 1
    warm-restart cycles of snapshot_epochs, each from the last; the j-th member of a cluster hatches from cycle j."""
    snapshot_epochs: float = 2.0
    """Epochs of each warm-restart cycle (peak training.lr, cosine to zero); counted in the mother's cost."""
    bagging: bool = False
    """Each hatched member trains on its own bootstrap resample of the training subset: diversity from the data,
    at no extra cost, where snapshot cycles buy it with mother epochs."""
    batch_size: int = 0
    """Batch size of the mother and its snapshot cycles (0 = training.batch_size). A small net's step costs
    about as much wall time as a member's on CPU (fixed per-op costs), so a mother pays off in fewer, larger steps."""
    lr_factor: float = 1.0
    """Peak learning rate of the mother and its snapshot cycles relative to training.lr (raise it with batch_size)."""

    def clusters_for(self, k: int) -> int:
        """g for an ensemble of k members."""
        return -(-k // self.members_per_cluster) if self.members_per_cluster else self.clusters

    def __post_init__(self):
        if self.clusters < 1 or self.members_per_cluster < 0:
            raise ValueError(f"mothernet: clusters must be >= 1 and members_per_cluster >= 0 (0 = use clusters), got "
                             f"{self.clusters} and {self.members_per_cluster}")
        if self.mother_epochs <= 0 or self.hatch_epochs < 0:
            raise ValueError("mothernet.mother_epochs must be > 0 and mothernet.hatch_epochs >= 0")
        if self.noise < 0 or self.calib_batch < 2 or self.hatch_lr_factor <= 0:
            raise ValueError("mothernet: noise must be >= 0, calib_batch >= 2 and hatch_lr_factor > 0")
        if any(b < 0 or b == 1 for b in (self.batch_size, self.hatch_batch_size)) or self.lr_factor <= 0:
            raise ValueError("mothernet: batch_size and hatch_batch_size must be 0 (= training.batch_size) or >= 2, "
                             "lr_factor > 0")
        if self.snapshots < 1 or self.snapshot_epochs <= 0:
            raise ValueError("mothernet: snapshots must be >= 1 (1 = one mother) and snapshot_epochs > 0")


@dataclass
class Training:
    epochs: float = 8.0
    """Epochs of each independently trained member (the baseline)."""
    batch_size: int = 128
    """Global batch size."""
    lr: float = 1.2e-2
    """Peak AdamW learning rate (linear warmup over 5% of steps, then cosine decay to zero); tuned on both built-in
    datasets (the default K=4 fashion run: independent ensemble 87.92% at 3e-3, 89.13% at 1.2e-2)."""
    weight_decay: float = 5e-4
    """AdamW weight decay."""
    engine: Literal["titan", "local"] = "titan"
    """titan: every net trains with titan.trainer.Trainer; local: a plain in-process loop (no titan needed)."""
    threads: int = 1
    """torch CPU threads (0 = torch's default); 1 is fastest for small nets on a busy 2-core machine."""
    spread: Literal["none", "members"] = "none"
    """Under torchrun: none = every net trains on all ranks (FSDP); members = mothers, then members, are dealt
    out over the ranks by cost, each trained on its rank alone (titan's solo mode); rank 0 gathers the results."""
    seed: int = 0
    """Seed of initialization and data order."""

    def __post_init__(self):
        if self.epochs <= 0 or self.batch_size < 2 or self.lr <= 0 or self.weight_decay < 0 or self.threads < 0:
            raise ValueError("training: epochs and lr must be > 0, batch_size >= 2, weight_decay and threads >= 0")
        if self.seed < 0:
            raise ValueError(f"training.seed must be >= 0, got {self.seed}")


@dataclass
class Run:
    out: str = "outputs/morphens"
    """Folder for results.json, results.png and the per-net titan dump folders."""
    baseline: bool = True
    """Also train the independent members (the comparison)."""
    sizes: list[int] = field(default_factory=list)
    """Sweep over ensemble sizes (the first k generated members each); empty = just ensemble.size."""

    def __post_init__(self):
        if any(k < 1 for k in self.sizes):
            raise ValueError(f"run.sizes must be positive ensemble sizes, got {self.sizes}")


@dataclass
class RunConfig:
    data: Data = field(default_factory=Data)
    ensemble: Ensemble = field(default_factory=Ensemble)
    mothernet: MotherNet = field(default_factory=MotherNet)
    training: Training = field(default_factory=Training)
    run: Run = field(default_factory=Run)


RUN_CONFIG = ConfigManager(RunConfig, "python -m morphens.run [--config PATH.toml|.json] [--section.key VALUE ...]")


def load_config(path: str = "", overrides: list[tuple[str, str]] = ()) -> RunConfig:
    """Defaults <- file at `path` (TOML, or JSON when it ends in .json; same sections) <- overrides
    `[("section.key", "value"), ...]`; a ConfigError names the key."""
    return RUN_CONFIG.load(path, overrides)


help_text = RUN_CONFIG.help_text
to_dict = RUN_CONFIG.to_dict
