"""The dataset file readers, on small files written in each official layout."""

import pickle
import shutil

import numpy as np
import pytest
from scipy.io import savemat
from tests.morphens.conftest import CIFAR10_BINARY, write_records

from morphens.data import load
from morphens.files import cifar, svhn

RNG = np.random.default_rng(0)


def images(n: int) -> np.ndarray:
    return RNG.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)


def test_cifar10_binary_and_python_layouts_read_the_same(tmp_path, cifar10_batches):
    root, parts = cifar10_batches
    python = tmp_path / "py" / "cifar-10-batches-py"
    python.mkdir(parents=True)
    for name, (x, y) in zip(CIFAR10_BINARY, parts):
        with open(python / name.removesuffix(".bin"), "wb") as f:
            pickle.dump({"data": x.reshape(len(x), -1), "labels": y.tolist(), "batch_label": name}, f, protocol=2)
    from_binary, from_python = cifar("cifar10", root, False), cifar("cifar10", tmp_path / "py", False)
    for a, b in zip(from_binary, from_python):
        np.testing.assert_array_equal(a, b)
    train_x, train_y, test_x, test_y = from_binary
    assert train_x.shape == (40, 3, 32, 32) and test_x.shape == (8, 3, 32, 32)
    np.testing.assert_array_equal(train_x[8], parts[1][0][0])  # channel-major records, batches in order
    np.testing.assert_array_equal(test_y, parts[5][1])


def test_cifar100_uses_the_fine_labels(tmp_path):
    x, coarse, fine = images(4), np.array([1, 2, 3, 4]), np.array([91, 5, 60, 99])
    (tmp_path / "cifar-100-binary").mkdir()
    for name in ("train", "test"):
        write_records(tmp_path / "cifar-100-binary" / f"{name}.bin", x, coarse, fine)
    data = load("cifar100", str(tmp_path))
    assert data.num_classes == 100 and data.test_y.tolist() == fine.tolist() and data.flip
    (tmp_path / "cifar-100-binary" / "train.bin").unlink()
    (tmp_path / "cifar-100-python").mkdir()
    for name in ("train", "test"):
        with open(tmp_path / "cifar-100-python" / name, "wb") as f:
            pickle.dump({b"data": x.reshape(4, -1), b"fine_labels": fine.tolist(), b"coarse_labels": coarse}, f,
                        protocol=5)
    with pytest.raises(FileNotFoundError, match="cifar-100-binary lacks train.bin; extract the whole"):
        cifar("cifar100", tmp_path, False)  # a broken binary layout is reported, not passed over
    shutil.rmtree(tmp_path / "cifar-100-binary")
    train_x, train_y, _, test_y = cifar("cifar100", tmp_path, False)  # protocol-5 pickles of the python layout
    np.testing.assert_array_equal(train_x, x)
    assert train_y.tolist() == test_y.tolist() == fine.tolist()


def test_svhn_mat_files_with_label_10_for_zero(tmp_path):
    x = images(5)
    for name in ("train", "test"):
        savemat(tmp_path / f"{name}_32x32.mat", {"X": x.transpose(2, 3, 1, 0), "y": np.array([[10, 1, 9, 10, 3]]).T})
    data = load("svhn", str(tmp_path))
    assert data.train_x.shape == (5, 3, 32, 32) and data.train_y.tolist() == [0, 1, 9, 0, 3] and not data.flip
    np.testing.assert_array_equal(data.test_x.numpy(), x)


class Exploit:
    def __reduce__(self):
        import os

        return os.system, ("touch pwned",)


def test_a_pickle_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": Exploit(), "labels": [0]}, f)
    with pytest.raises(ValueError, match=r"not a CIFAR python batch \(refusing to load (posix|os)\.system\)"):
        cifar("cifar10", tmp_path, False)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-7]), "not a whole number of 3073-byte CIFAR records"),
        (lambda f: f.unlink(), "lacks data_batch_2.bin"),
    ],
)
def test_damaged_cifar_files_are_named(cifar10_batches, damage, message):
    root, _ = cifar10_batches
    damage(root / "cifar-10-batches-bin" / "data_batch_2.bin")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        cifar("cifar10", root, False)


def test_labels_out_of_range_mean_wrong_files(tmp_path):
    for name in ("train", "test"):
        savemat(tmp_path / f"{name}_32x32.mat", {"X": images(2).transpose(2, 3, 1, 0), "y": np.array([[1], [12]])})
    with pytest.raises(ValueError, match="train_32x32.mat: labels outside 1..10"):
        load("svhn", str(tmp_path))
    (tmp_path / "cifar-10-batches-bin").mkdir()
    for name in CIFAR10_BINARY:
        write_records(tmp_path / "cifar-10-batches-bin" / name, images(1), np.array([12]))
    with pytest.raises(ValueError, match="cifar10: the files hold no uint8 images with labels 0..9"):
        load("cifar10", str(tmp_path))


def test_missing_svhn_says_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_32x32.mat not found .* download http://ufldl"):
        svhn(tmp_path, False)


def test_download_fetches_the_official_archive_then_reads_it(tmp_path, monkeypatch, cifar10_batches):
    import torchvision.datasets.utils

    _, parts = cifar10_batches
    fetched = []

    def fake_download(url, root, md5=None):  # what the archive holds: the python layout
        fetched.append((url, md5))
        folder = tmp_path / "fresh" / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        for name, (x, y) in zip(CIFAR10_BINARY, parts):
            with open(folder / name.removesuffix(".bin"), "wb") as f:
                pickle.dump({"data": x.reshape(len(x), -1), "labels": y.tolist()}, f)

    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", fake_download)
    with pytest.raises(FileNotFoundError):
        cifar("cifar10", tmp_path / "fresh", False)
    train_x, *_ = cifar("cifar10", tmp_path / "fresh", True)
    assert fetched == [("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a")]
    assert train_x.shape == (40, 3, 32, 32)
    cifar("cifar10", tmp_path / "fresh", True)  # files present: no second download
    assert len(fetched) == 1
