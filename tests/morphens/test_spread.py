"""Spreading an ensemble over the ranks of a torchrun job (`training.spread members`, titan's solo mode)."""

import json

import pytest
from tests.titan.conftest import run_train

from morphens.config import load_config
from morphens.experiment import independent, mothernets, prepare, snapshot_ensemble
from morphens.spec import SPEC
from morphens.spread import deal
from morphens.train import eval_labels

SMALL = {"data.dataset": "digits", "ensemble.family": "mlp", "ensemble.size": "3", "ensemble.width": "4",
         "training.batch_size": "64", "training.epochs": "1", "mothernet.mother_epochs": "1",
         "mothernet.hatch_epochs": "1"}


def test_nets_are_dealt_costliest_first_to_the_least_loaded_rank():
    """Fashion K=8's independent members (their seconds as costs): dealt in turn, rank 0 got 132.5 s and rank 1
    79.3 s; dealt by cost the ranks get 109.7 and 102.1 s. Equal costs go to the ranks in order."""
    seconds = [47.5, 17.1, 25.9, 13.6, 28.4, 21.6, 30.7, 27.0]
    ranks = deal(seconds, 2)
    assert ranks == [0, 1, 1, 0, 1, 0, 1, 0]
    assert [round(sum(s for s, r in zip(seconds, ranks) if r == rank), 1) for rank in (0, 1)] == [109.7, 102.1]
    assert deal([1.0, 1.0, 1.0], 3) == [0, 1, 2] and deal([], 2) == []


@pytest.mark.slow  # ~15 s of CPU, mostly two processes importing torch; over a minute on a busy 2-core box
def test_spread_mothers_and_members_train_alone_on_their_ranks_as_in_one_process(tmp_path):
    """Two ranks, six members in two clusters: rank 0 trains mother 0, rank 1 mother 1, each alone through titan,
    and both get both mothers' snapshots; then rank 0 trains members 0, 2, 4 and rank 1 members 1, 3, 5, rank 0
    the snapshot ensemble's chain, and rank 0 writes everything. Every net equals the one a single process trains
    in turn (same seeds, same single-process numerics: exactly equal accuracies), hatched members included, so the
    snapshots arrived whole."""
    small = {**SMALL, "ensemble.size": "6", "mothernet.members_per_cluster": "3", "mothernet.snapshots": "2",
             "mothernet.snapshot_epochs": "0.5", "snapshot.cycle_epochs": "0.5",
             "run.methods": "mothernets,independent,snapshot"}
    cli = [arg for key, value in small.items() for arg in (f"--{key}", value)]
    run_train([*cli, "--training.spread", "members", "--run.out", str(tmp_path / "spread")], nproc=2,
              module="morphens.run")
    spread = {r["method"]: r for r in json.loads((tmp_path / "spread/results.json").read_text())["results"]}
    cfg = load_config("", [*small.items(), ("run.out", str(tmp_path / "one"))])
    data, members, _ = prepare(cfg)
    labels = eval_labels(data)
    assert spread["independent"]["member_acc"] == [r.acc for r in independent(cfg, data, members, labels)]
    one = mothernets(cfg, data, members, labels)
    assert spread["mothernets"]["clusters"] == 2
    assert [m["snapshot_acc"] for m in spread["mothernets"]["mothers"]] == [m.snapshot_acc for m in one.mothers]
    assert spread["mothernets"]["member_acc"] == one.member_acc
    assert spread["mothernets"]["train_cost"] == one.train_cost
    assert spread["snapshot"]["member_acc"] == snapshot_ensemble(cfg, data, members, labels).member_acc
    for name in ("independent-5", "mother-1-of-6", "mother-1-of-6-snapshot-1", "hatched-5-of-6"):
        assert (tmp_path / f"spread/nets/{name}/metrics.jsonl").is_file()  # rank 1's solo trainers wrote theirs


def test_a_solo_trainer_refuses_checkpoints(tmp_path):
    """Checkpoints synchronize every rank of the job, which a net trained on one rank alone must not do."""
    from titan.config import JobConfig
    from titan.trainer import Trainer

    job = JobConfig()
    job.job.dump_folder, job.model.name, job.model.flavor = str(tmp_path), "morphnet", "digits_mlp"
    job.checkpoint.enable = True
    with pytest.raises(ValueError, match="checkpoint.enable with solo=True"):
        Trainer(job, model_spec=SPEC, solo=True)
