from pathlib import Path

import pytest
import torch

from morphens.data import FASHION_MNIST_DIR, Loader, augment, load


def test_digits_split_and_normalization():
    data = load("digits")
    assert data.in_shape == (1, 8, 8) and data.num_classes == 10
    assert len(data.train_y) + len(data.test_y) == 1797
    x, y = next(iter(Loader(data, 512, augmented=False)))
    assert x.shape == (512, 1, 8, 8) and y.dtype == torch.int64
    assert abs(float(x.mean())) < 0.1 and abs(float(x.std()) - 1) < 0.1


def test_train_loader_resumes_with_the_same_batches():
    data = load("digits")
    loader = Loader(data, 100, seed=3)
    it = iter(loader)
    for _ in range(16):  # past the end of the first epoch (14 steps)
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = Loader(data, 100, seed=3)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(iter(resumed), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_nearby_seeds_do_not_give_epoch_shifted_orders():
    """Loader seeds i and i + 1 (two members) must not share permutations one epoch apart."""
    data = load("digits")
    labels = []
    for seed in (5, 6):
        loader = Loader(data, 100, augmented=False, seed=seed)
        it = iter(loader)
        labels.append([next(it)[1] for _ in range(loader.steps_per_epoch + 1)])
    assert not torch.equal(labels[0][-1], labels[1][0])  # seed 5's second epoch vs seed 6's first


def test_ranks_see_disjoint_shares_and_test_split_is_one_pass():
    data = load("digits")
    seen = []
    for rank in range(2):
        loader = Loader(data, 64, augmented=False, rank=rank, world=2, limit=256)
        seen.append(torch.cat([x for x, _, in (next(iter(loader)), next(iter(loader)))]))
    assert not any(torch.equal(a, b) for a in seen[0] for b in seen[1])
    test = list(Loader(data, 100, split="validation"))
    assert sum(len(y) for _, y in test) == len(data.test_y) and len(test) == 4


def test_bootstrap_resamples_the_training_subset_with_replacement():
    data = load("digits")
    subset = next(iter(Loader(data, 256, augmented=False, limit=256)))[0]
    epochs = {seed: next(iter(Loader(data, 256, augmented=False, limit=256, bootstrap=seed)))[0] for seed in (1, 2)}
    for x in epochs.values():
        rows = {tuple(r.tolist()) for r in x.flatten(1)}
        assert rows <= {tuple(r.tolist()) for r in subset.flatten(1)}
        assert 140 < len(rows) < 190  # a resample of n keeps about 1 - 1/e of the distinct images (162 of 256)
    assert not torch.equal(epochs[1], epochs[2])
    again = next(iter(Loader(data, 256, augmented=False, limit=256, bootstrap=1)))[0]
    assert torch.equal(again, epochs[1])
    test = torch.cat([y for _, y in Loader(data, 100, split="test", bootstrap=1)])
    assert torch.equal(test, data.test_y)


def test_augment_shifts_and_flips_whole_images():
    x = torch.arange(6 * 3 * 5 * 5.0).view(6, 3, 5, 5) + 1  # three channels move together
    out = augment(x, 1, True, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    for img, src in zip(out, x):
        # each output is a shifted (and maybe mirrored) crop of the zero-padded source
        padded = torch.nn.functional.pad(src, (1, 1, 1, 1))
        crops = [padded[:, i:i + 5, j:j + 5] for i in range(3) for j in range(3)]
        assert any(torch.equal(img, c) or torch.equal(img, c.flip(-1)) for c in crops)


@pytest.mark.skipif(not Path(FASHION_MNIST_DIR).exists(),
                    reason="Fashion-MNIST absent: `apt-get install -y dataset-fashion-mnist` to run this test")
def test_fashion_mnist_from_the_debian_package():
    data = load("fashion_mnist")
    assert data.train_x.shape == (60000, 1, 28, 28) and data.test_x.shape == (10000, 1, 28, 28)
    assert data.num_classes == 10 and data.flip


def test_missing_files_say_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        load("fashion_mnist", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nor cifar-10-batches-py/ found .* --data.download true"):
        load("cifar10", str(tmp_path))
    with pytest.raises(ValueError, match="unknown 'imagenet'"):
        load("imagenet")
