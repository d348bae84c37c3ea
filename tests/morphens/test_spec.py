import pytest
import torch

from morphens.arch import VGG, Conv
from morphens.config import load_config
from morphens.data import load
from morphens.models import Net
from morphens.morph import hatch
from morphens.spec import FLAVORS, SPEC, parse_dataset_uri, train_with_titan
from morphens.train import accuracy, eval_labels, predict, seeded

MOTHER = VGG((1, 8, 8), 10, ((Conv(4),), (Conv(8),)))
MEMBER = VGG((1, 8, 8), 10, ((Conv(6, 5), Conv(6)), (Conv(12),)))


@pytest.fixture
def cfg(tmp_path):
    return load_config("", [("data.dataset", "digits"), ("training.batch_size", "64"), ("run.out", str(tmp_path))])


def test_titan_starts_a_hatched_member_from_its_weights_and_trains_it(cfg):
    child = hatch(seeded(MOTHER, 0), MEMBER, noise=0.01, calib=torch.randn(32, 1, 8, 8))
    untouched = train_with_titan(child, cfg, 0, 1e-3, 0, "zero-steps")
    for name, value in child.state_dict().items():
        assert torch.equal(untouched.state_dict()[name], value), name
    data = load("digits")
    labels = eval_labels(data)
    trained = train_with_titan(child, cfg, 60, 3e-3, 0, "sixty-steps")
    assert accuracy(predict(trained, data), labels) > accuracy(predict(child, data), labels) + 30


def test_titan_resumes_a_member_from_its_checkpoint(cfg, tmp_path):
    from titan.builders import BuildInputs
    from titan.config import JobConfig
    from titan.trainer import Trainer

    job = JobConfig()
    job.job.dump_folder = str(tmp_path / "resume")
    job.model.name, job.model.flavor = "morphnet", "digits_mlp"
    job.training.dataset, job.training.steps, job.training.local_batch_size = "digits?augment=false", 6, 32
    job.training.mixed_precision_param = "float32"
    job.checkpoint.enable, job.checkpoint.interval = True, 3
    job.metrics.enable_tensorboard, job.metrics.log_freq = False, 1
    Trainer(job, BuildInputs(model_spec=SPEC)).train()
    job.training.steps = 9
    history = Trainer(job, BuildInputs(model_spec=SPEC)).train()
    assert history[0]["step"] == 7 and history[-1]["step"] == 9


@pytest.mark.parametrize("flavor", FLAVORS)
def test_flavors_build_on_meta_and_run(flavor):
    arch = FLAVORS[flavor]
    with torch.device("meta"):
        assert SPEC.build_model(arch)(torch.empty(2, *arch.in_shape)).shape == (2, arch.num_classes)


def test_dataset_uri():
    assert parse_dataset_uri("fashion_mnist?train_limit=100&bootstrap=7&augment=false") == (
        "fashion_mnist", {"train_limit": 100, "bootstrap": 7, "augment": False})
    with pytest.raises(ValueError, match="unknown option 'crop'"):
        parse_dataset_uri("digits?crop=2")
    assert isinstance(Net(MEMBER), SPEC.build_model)
