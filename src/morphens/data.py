"""Image datasets held in memory as uint8 tensors, and a resumable, rank-sharded batch loader with augmentation.

Offline: scikit-learn digits (in its wheel) and Fashion-MNIST (Debian package dataset-fashion-mnist).
CIFAR-10/100 and SVHN when their files are under the path (./data by default), or downloaded with `download`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from morphens.files import cifar, read_idx, svhn

CLASSES = {"digits": 10, "fashion_mnist": 10, "cifar10": 10, "cifar100": 100, "svhn": 10}
DATASETS = tuple(CLASSES)
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: torch.Tensor
    """uint8 (N, C, H, W)."""
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    pad: int
    """Random-crop padding of the standard augmentation."""
    flip: bool
    """Whether horizontal flips keep the label (not for digits)."""

    @property
    def in_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])

    @functools.cached_property
    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std of the training images, shaped to broadcast over (N, C, H, W)."""
        x = self.train_x.float()
        return x.mean((0, 2, 3)).view(1, -1, 1, 1), x.std((0, 2, 3)).view(1, -1, 1, 1)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.stats
        return (x.float() - mean) / std


def _fashion_mnist(path: str) -> tuple[np.ndarray, ...]:
    root = Path(path or FASHION_MNIST_DIR)
    out = []
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        found = [p for p in (root / f"{stem}.gz", root / stem, root / "FashionMNIST/raw" / stem) if p.exists()]
        if not found:
            raise FileNotFoundError(f"fashion_mnist: {stem}[.gz] not found under {root}; install it with "
                                    "`sudo apt-get install -y dataset-fashion-mnist` or set data.path")
        out.append(read_idx(found[0]))
    return out[0][:, None], out[1], out[2][:, None], out[3]


def _digits() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = np.round(x.reshape(-1, 1, 8, 8) * (255 / 16)).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(y))  # fixed 80/20 split
    cut = len(y) * 4 // 5
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


@functools.lru_cache(maxsize=4)
def load(name: str, path: str = "", download: bool = False) -> Dataset:
    """Loads a dataset once per process (several trainers in one run share it)."""
    if name not in DATASETS:
        raise ValueError(f"data.dataset: unknown {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "digits":
        arrays = _digits()
    elif name == "fashion_mnist":
        arrays = _fashion_mnist(path)
    elif name == "svhn":
        arrays = svhn(Path(path or "./data"), download)
    else:
        arrays = cifar(name, Path(path or "./data"), download)
    tx, ty, vx, vy = (torch.from_numpy(np.array(a)) for a in arrays)
    ty, vy = ty.long(), vy.long()
    labels = torch.cat([ty, vy])
    if tx.dtype != torch.uint8 or tx.ndim != 4 or labels.min() < 0 or labels.max() >= CLASSES[name]:
        raise ValueError(f"{name}: the files hold no uint8 images with labels 0..{CLASSES[name] - 1}; "
                         "replace them with the official files")
    pad, flip = {"digits": (1, False), "fashion_mnist": (2, True), "svhn": (4, False)}.get(name, (4, True))
    return Dataset(name, tx, ty, vx, vy, CLASSES[name], pad, flip)


def derived_seed(*key: int) -> int:
    """A 32-bit seed from non-negative integers (a base seed, a role, indices): distinct keys give unrelated
    streams, where `base + offset` makes member i's second epoch repeat member i+1's first."""
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def augment(x: torch.Tensor, pad: int, flip: bool, gen: torch.Generator) -> torch.Tensor:
    """Random crop after zero padding (a shift of up to `pad` pixels) and optional horizontal flip, per sample."""
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy, dx = (torch.randint(2 * pad + 1, (n, 1, 1), generator=gen) for _ in range(2))
    cols = torch.arange(w).view(1, 1, w) + dx
    if flip:
        mirrored = torch.rand(n, 1, 1, generator=gen) < 0.5
        cols = torch.where(mirrored, cols.flip(-1), cols)
    # One gather along each padded image's flat pixels: a third of the time of indexing by rows and columns.
    pixels = ((torch.arange(h).view(1, h, 1) + dy) * (w + 2 * pad) + cols).view(n, 1, h * w)
    return padded.view(n, c, -1).gather(2, pixels.expand(n, c, h * w)).view(n, c, h, w)


class Loader:
    """Normalized float batches of one split for one data-parallel rank.

    The train split cycles forever over reshuffled epochs (each rank takes a strided share of one permutation,
    dropping the ragged end so BatchNorm never sees a tiny batch); the test split is one ordered pass. `limit`
    keeps a fixed random subset of the split; `bootstrap` (a seed, 0 = off) then resamples that training subset
    with replacement, for bagging.
    `state_dict()` records the position, so a resumed run continues with the same batches.
    """

    def __init__(self, data: Dataset, batch_size: int, split: str = "train", augmented: bool = True,
                 seed: int = 0, rank: int = 0, world: int = 1, limit: int = 0, bootstrap: int = 0):
        if split not in ("train", "test", "validation"):
            raise ValueError(f"split must be train or validation, got {split!r}")
        self.data, self.batch_size, self.train = data, batch_size, split == "train"
        self.x, self.y = (data.train_x, data.train_y) if self.train else (data.test_x, data.test_y)
        if limit:  # a fixed random subset, the same for every rank and member
            keep = torch.randperm(len(self.y), generator=torch.Generator().manual_seed(0))[:limit]
            self.x, self.y = self.x[keep], self.y[keep]
        if bootstrap and self.train:
            drawn = torch.randint(len(self.y), (len(self.y),), generator=torch.Generator().manual_seed(bootstrap))
            self.x, self.y = self.x[drawn], self.y[drawn]
        self.augmented, self.seed, self.rank, self.world = augmented and self.train, seed, rank, world
        self.epoch = self.step = 0

    @property
    def steps_per_epoch(self) -> int:
        share = len(self.y) // self.world
        return max(share // self.batch_size, 1) if self.train else -(-share // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self):
        while True:
            if self.train:
                gen = torch.Generator().manual_seed(derived_seed(self.seed, self.epoch))
                order = torch.randperm(len(self.y), generator=gen)
            else:
                order = torch.arange(len(self.y))
            mine = order[self.rank::self.world]
            while self.step < self.steps_per_epoch:
                idx = mine[self.step * self.batch_size:(self.step + 1) * self.batch_size]
                self.step += 1
                x = self.x[idx]
                if self.augmented:
                    gen = torch.Generator().manual_seed(hash((self.seed, self.epoch, self.step, self.rank)))
                    x = augment(x, self.data.pad, self.data.flip, gen)
                yield self.data.normalize(x), self.y[idx]
            self.epoch, self.step = self.epoch + 1, 0
            if not self.train:
                self.epoch = 0
                return

    def state_dict(self) -> dict[str, Any]:
        """Images this rank has consumed (titan checkpoints this integer as `sample_position`)."""
        return {"sample_position": (self.epoch * self.steps_per_epoch + self.step) * self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = divmod(state["sample_position"] // self.batch_size, self.steps_per_epoch)
