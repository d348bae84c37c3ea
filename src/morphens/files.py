"""Readers of the image datasets' own file formats, returning uint8 (N, C, H, W) images and int labels.

CIFAR comes in two official layouts: the binary one (fixed-size records, read here with numpy) and the python one
(pickles of numpy arrays); the pickles are read by an unpickler that rebuilds numpy arrays and nothing else, so a
tampered file cannot run code. SVHN is MATLAB v5 (scipy.io), Fashion-MNIST IDX (optionally gzipped).
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""train images, train labels, test images, test labels."""


@dataclass(frozen=True)
class CifarFiles:
    binary_dir: str
    binary_train: tuple[str, ...]
    binary_test: tuple[str, ...]
    label_bytes: int
    """Label bytes at the start of each binary record; the last one is the label used (CIFAR-100: fine)."""
    python_dir: str
    python_train: tuple[str, ...]
    python_test: tuple[str, ...]
    label_key: str
    url: str
    """The python-layout archive, what --data.download fetches."""
    md5: str


CIFAR = {
    "cifar10": CifarFiles(
        "cifar-10-batches-bin", tuple(f"data_batch_{i}.bin" for i in range(1, 6)), ("test_batch.bin",), 1,
        "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "labels",
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": CifarFiles(
        "cifar-100-binary", ("train.bin",), ("test.bin",), 2,
        "cifar-100-python", ("train",), ("test",), "fine_labels",
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}
SVHN = (  # train, test
    ("http://ufldl.stanford.edu/housenumbers/train_32x32.mat", "e26dedcc434d2e4c54c9b2d4a06d8373"),
    ("http://ufldl.stanford.edu/housenumbers/test_32x32.mat", "eb5a983be6a315427106f1b164d9cef3"),
)


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = np.frombuffer(raw, ">u4", count=dims, offset=4)
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, strings and numpy arrays; any other global in the stream is refused."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),  # protocol 5
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}  # bytes in Python 3's protocol 2

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _cifar_pickle(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="latin1").load()
        images, labels = batch.get("data", batch.get(b"data")), batch.get(label_key, batch.get(label_key.encode()))
        return np.asarray(images, np.uint8).reshape(-1, 3, 32, 32), np.asarray(labels, np.int64)
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a CIFAR python batch ({e}); replace it with the official file") from None


def _cifar_binary(path: Path, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, np.uint8)
    record = label_bytes + 3 * 32 * 32
    if raw.size == 0 or raw.size % record:
        raise ValueError(f"{path} holds {raw.size} bytes, not a whole number of {record}-byte CIFAR records; "
                         "replace it with the official file")
    raw = raw.reshape(-1, record)
    return raw[:, label_bytes:].reshape(-1, 3, 32, 32), raw[:, label_bytes - 1].astype(np.int64)


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def cifar(name: str, root: Path, download: bool) -> Arrays:
    """CIFAR-10 or CIFAR-100 (fine labels) from its binary or python layout under `root`."""
    f = CIFAR[name]
    if not (root / f.binary_dir).is_dir() and not (root / f.python_dir).is_dir() and download:
        from torchvision.datasets.utils import download_and_extract_archive

        download_and_extract_archive(f.url, str(root), md5=f.md5)
    for folder, train, test, read, arg in ((f.binary_dir, f.binary_train, f.binary_test, _cifar_binary, f.label_bytes),
                                           (f.python_dir, f.python_train, f.python_test, _cifar_pickle, f.label_key)):
        if (root / folder).is_dir():
            missing = [n for n in train + test if not (root / folder / n).is_file()]
            if missing:
                raise FileNotFoundError(f"{name}: {root / folder} lacks {', '.join(missing)}; extract the "
                                        "whole official archive there")
            return (*_joined([read(root / folder / n, arg) for n in train]),
                    *_joined([read(root / folder / n, arg) for n in test]))
    raise FileNotFoundError(f"{name}: neither {f.binary_dir}/ nor {f.python_dir}/ found under {root}; extract "
                            f"{f.url} there or pass --data.download true (needs internet)")


def svhn(root: Path, download: bool) -> Arrays:
    """SVHN's cropped digits (train and test .mat files; label 10 means the digit 0)."""
    from scipy.io import loadmat

    out = []
    for url, md5 in SVHN:
        path = root / Path(url).name
        if not path.is_file() and download:
            from torchvision.datasets.utils import download_url

            download_url(url, str(root), md5=md5)
        if not path.is_file():
            raise FileNotFoundError(f"svhn: {path.name} not found under {root}; download {url} there or pass "
                                    "--data.download true (needs internet)")
        try:
            mat = loadmat(path)
            images, labels = mat["X"], mat["y"].reshape(-1).astype(np.int64)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"{path} is not an SVHN .mat file ({e}); replace it with the official file") from None
        if labels.size and (labels.min() < 1 or labels.max() > 10):
            raise ValueError(f"{path}: labels outside 1..10; replace it with the official file")
        out += [np.ascontiguousarray(images.transpose(3, 2, 0, 1)), labels % 10]
    return tuple(out)
