import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread, morphens' default (`training.threads`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CIFAR10_BINARY = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def write_records(path, x, *label_columns):
    """CIFAR's binary layout: per image, its label bytes, then 3 x 32 x 32 channel-major pixels."""
    records = np.concatenate([np.stack(label_columns, 1).astype(np.uint8), x.reshape(len(x), -1)], 1)
    records.tofile(path)


@pytest.fixture
def cifar10_batches(tmp_path):
    """(root, [(images, labels)] per file of CIFAR10_BINARY): 8 random images per file in cifar-10-batches-bin/."""
    rng = np.random.default_rng(0)
    parts = [(rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, 8)) for _ in CIFAR10_BINARY]
    folder = tmp_path / "cifar" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    for name, (x, y) in zip(CIFAR10_BINARY, parts):
        write_records(folder / name, x, y)
    return tmp_path / "cifar", parts
