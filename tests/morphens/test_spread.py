"""Spreading an ensemble over the ranks of a torchrun job (`training.spread members`, titan's solo mode)."""

import json

import pytest
from tests.titan.conftest import run_train

from morphens.config import load_config
from morphens.experiment import independent, mothernets, prepare
from morphens.spec import SPEC
from morphens.train import eval_labels

SMALL = {"data.dataset": "digits", "ensemble.family": "mlp", "ensemble.size": "3", "ensemble.width": "4",
         "training.batch_size": "64", "training.epochs": "1", "mothernet.mother_epochs": "1",
         "mothernet.hatch_epochs": "1"}


@pytest.mark.slow  # ~15 s of CPU, mostly two processes importing torch; over a minute on a busy 2-core box
def test_spread_members_train_alone_on_their_ranks_as_in_one_process(tmp_path):
    """Two ranks, three members: rank 0 trains members 0 and 2, rank 1 member 1, each alone through titan, and
    rank 0 writes the whole ensemble. Independent members equal those of one process training them in turn
    (same seeds, same single-process numerics: exactly equal accuracies). Hatched members grow from a mother
    trained on both ranks (FSDP, per-rank BatchNorm statistics), unlike in one process, so they agree only
    within 5 points after this one-epoch run."""
    cli = [arg for key, value in SMALL.items() for arg in (f"--{key}", value)]
    run_train([*cli, "--training.spread", "members", "--run.out", str(tmp_path / "spread")], nproc=2,
              module="morphens.run")
    spread = {r["method"]: r for r in json.loads((tmp_path / "spread/results.json").read_text())["results"]}
    cfg = load_config("", [*SMALL.items(), ("run.out", str(tmp_path / "one"))])
    data, members, _ = prepare(cfg)
    labels = eval_labels(data)
    assert spread["independent"]["member_acc"] == [r["acc"] for r in independent(cfg, data, members, labels)]
    one = mothernets(cfg, data, members, labels)
    assert spread["mothernets"]["member_acc"] == pytest.approx(one["member_acc"], abs=5.0)
    assert spread["mothernets"]["train_cost"] == one["train_cost"]
    for i in range(3):  # every rank's solo trainer writes its nets' metrics, rank 1's included
        assert (tmp_path / f"spread/nets/independent-{i}/metrics.jsonl").is_file()


def test_a_solo_trainer_refuses_checkpoints(tmp_path):
    """Checkpoints synchronize every rank of the job, which a net trained on one rank alone must not do."""
    from titan.config import JobConfig
    from titan.trainer import Trainer

    job = JobConfig()
    job.job.dump_folder, job.model.name, job.model.flavor = str(tmp_path), "morphnet", "digits_mlp"
    job.checkpoint.enable = True
    with pytest.raises(ValueError, match="checkpoint.enable with solo=True"):
        Trainer(job, model_spec=SPEC, solo=True)
