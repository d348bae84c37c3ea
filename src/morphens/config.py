"""Run configuration: typed sections from defaults, then a TOML or JSON file, then `--section.key value`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from morphens.arch import Generator
from morphens.data import DATASETS
from titan.config.manager import ConfigManager
from titan.distributed.runtime import device_type


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
    """Base width of generated members (block b draws from width * 2**b * [1, width_ratio])."""
    width_ratio: float = 1.5
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
        return Generator(self.family, self.blocks, self.width, self.width_ratio, self.max_depth, tuple(self.kernels))


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
    """Peak AdamW learning rate (linear warmup over 5% of steps, then cosine decay to zero)."""
    weight_decay: float = 5e-4
    """AdamW weight decay."""
    engine: Literal["titan", "local"] = "titan"
    """titan: every net trains with titan.trainer.Trainer; local: a plain in-process loop (no titan needed)."""
    threads: int = 1
    """torch CPU threads (0 = torch's default); 1 is fastest for small nets on a busy 2-core machine."""
    spread: Literal["none", "members"] = "none"
    """Under torchrun: none = every net trains on all ranks (FSDP); members = mothers, then members, are dealt
    out over the ranks by cost, each trained on its rank alone (titan's solo mode); rank 0 gathers the results.
    A snapshot ensemble is one chain of cycles: every rank trains it alone, alike."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where nets train and evaluate, batches included (auto = CUDA where torch sees a GPU, else the CPU). The
    titan engine trains on the machine's device, so it takes only auto or that device."""
    seed: int = 0
    """Seed of initialization and data order."""

    def __post_init__(self):
        if self.epochs <= 0 or self.batch_size < 2 or self.lr <= 0 or self.weight_decay < 0 or self.threads < 0:
            raise ValueError("training: epochs and lr must be > 0, batch_size >= 2, weight_decay and threads >= 0")
        if self.seed < 0:
            raise ValueError(f"training.seed must be >= 0, got {self.seed}")
        machine = device_type()
        if self.device == "cuda" and machine != "cuda":
            raise ValueError("training.device cuda: torch sees no CUDA device here; use auto or cpu")
        if self.engine == "titan" and self.device not in ("auto", machine):
            raise ValueError(f"training.device {self.device}: the titan engine trains on this machine's device "
                             f"({machine}); use auto, or --training.engine local")

    def torch_device(self) -> torch.device:
        return torch.device(device_type() if self.device == "auto" else self.device)


@dataclass
class Snapshot:
    """Snapshot Ensembles (Huang et al., 2017): one net trained through `cycles` warm-restart cycles of cosine
    learning rate, the last K cycles' end points averaged as an ensemble of K."""

    cycles: int = 0
    """Cycles of the chain (0 = the ensemble size K; at least K)."""
    cycle_epochs: float = 2.0
    """Epochs of each cycle (peak lr after a 5% warmup, cosine to zero; AdamW's moments restart with the cycle)."""
    member: int = -1
    """Which of the first K members' architectures the chain trains (-1 = the median one by forward FLOPs)."""
    batch_size: int = 0
    """Batch size of the chain (0 = training.batch_size)."""
    lr_factor: float = 1.0
    """Peak learning rate of every cycle relative to training.lr."""

    def __post_init__(self):
        if self.cycles < 0 or self.cycle_epochs <= 0 or self.lr_factor <= 0 or self.member < -1:
            raise ValueError("snapshot: cycles must be >= 0 (0 = K), cycle_epochs and lr_factor > 0, member >= -1 "
                             "(-1 = the median member)")
        if self.batch_size < 0 or self.batch_size == 1:
            raise ValueError("snapshot.batch_size must be 0 (= training.batch_size) or >= 2")


METHODS = ("mothernets", "independent", "snapshot", "matched_snapshot")


@dataclass
class Run:
    out: str = "outputs/morphens"
    """Folder for results.json, results.png and the per-net titan dump folders."""
    methods: list[str] = field(default_factory=lambda: ["mothernets", "independent"])
    """Methods trained at every size and budget, in this order: mothernets, independent (every member from
    scratch, the baseline), snapshot (Snapshot Ensembles), matched_snapshot (a Snapshot Ensemble whose cycles are
    scaled so that its chain takes about MotherNets' training time at the same size and budget; needs mothernets
    and snapshot before it)."""
    sizes: list[int] = field(default_factory=list)
    """Sweep over ensemble sizes (the first k generated members each); empty = just ensemble.size."""
    budgets: list[float] = field(default_factory=list)
    """Sweep over training budgets: each scales every epoch count of every method (training.epochs, the mothers',
    their cycles', the hatched members' and the snapshot cycles'); empty = [1]. The accuracy-time frontier."""

    def __post_init__(self):
        if any(k < 1 for k in self.sizes):
            raise ValueError(f"run.sizes must be positive ensemble sizes, got {self.sizes}")
        if any(b <= 0 for b in self.budgets):
            raise ValueError(f"run.budgets must be positive factors of the epoch counts, got {self.budgets}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods or len(set(self.methods)) < len(self.methods):
            raise ValueError(f"run.methods: {', '.join(unknown) or 'empty or repeated'}; give each of "
                             f"{', '.join(METHODS)} at most once")
        matched = self.methods.index("matched_snapshot") if "matched_snapshot" in self.methods else None
        if matched is not None and not {"mothernets", "snapshot"} <= set(self.methods[:matched]):
            raise ValueError("run.methods: matched_snapshot is sized from the mothernets and snapshot runs; list "
                             "both before it")


@dataclass
class RunConfig:
    data: Data = field(default_factory=Data)
    ensemble: Ensemble = field(default_factory=Ensemble)
    mothernet: MotherNet = field(default_factory=MotherNet)
    training: Training = field(default_factory=Training)
    snapshot: Snapshot = field(default_factory=Snapshot)
    run: Run = field(default_factory=Run)


RUN_CONFIG = ConfigManager(RunConfig, "python -m morphens.run [--config PATH.toml|.json] [--section.key VALUE ...]")


def load_config(path: str = "", overrides: list[tuple[str, str]] = ()) -> RunConfig:
    """Defaults <- file at `path` (TOML, or JSON when it ends in .json; same sections) <- overrides
    `[("section.key", "value"), ...]`; a ConfigError names the key."""
    return RUN_CONFIG.load(path, overrides)


help_text = RUN_CONFIG.help_text
to_dict = RUN_CONFIG.to_dict
