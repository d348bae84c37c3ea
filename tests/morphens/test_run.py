import json

import pytest
import torch

from morphens import run
from morphens.arch import forward_flops
from morphens.config import load_config
from morphens.morph import hatch
from morphens.mother import mother_of
from morphens.run import independent, main, mothernets, prepare
from morphens.train import eval_labels, steps_for

DIGITS = ["--data.dataset", "digits", "--training.batch_size", "64"]


def tiny_mlp_ensemble(tmp_path, settings: dict[str, str]):
    """(config, data, members) of a quick local-engine MLP ensemble on digits; `settings` override the defaults."""
    defaults = {"data.dataset": "digits", "ensemble.family": "mlp", "training.batch_size": "64",
                "training.engine": "local", "mothernet.hatch_epochs": "0.1", "run.out": str(tmp_path)}
    cfg = load_config("", list({**defaults, **settings}.items()))
    data, members, _ = prepare(cfg)
    return cfg, data, members


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.epochs", "many"], "error: training.epochs must be a number, got 'many'"),
        (["--training.engine", "jax"], "error: training.engine must be one of 'titan', 'local', got 'jax'"),
        (["--optimizer.lr", "1"], "error: unknown config section 'optimizer'"),
        (["--training.learning_rate", "1"], "error: unknown key training.learning_rate"),
        (["--ensemble.size", "0"], "error: ensemble.size must be >= 1"),
        (["--ensemble.family", "densenet"], "error: ensemble: family 'densenet' is unknown; choose vgg"),
        (["--ensemble.kernels", "3,4"], "error: ensemble: conv: kernel must be a positive odd integer"),
        (["--mothernet.snapshots", "0"], "error: mothernet: snapshots must be >= 1"),
        (["--training.seed", "-1"], "error: training.seed must be >= 0, got -1"),
        (["--mothernet.members_per_cluster", "-2"], "error: mothernet: clusters must be >= 1 and members_per_cluster"),
        (["--mothernet.clusters", "5", "--ensemble.size", "4"], "error: mothernet.clusters: g=5 is larger than"),
        (["--sizes", "1,2", "--mothernet.clusters", "2"], "error: mothernet.clusters: g=2 is larger than the "
                                                          "ensemble size 1"),
        (["--ensemble.family", "mixed", "--ensemble.size", "9"], "error: clusters: g=1 but the members form 3 groups"),
        (["--data.dataset", "cifar10", "--data.path", "/nonexistent"], "error: cifar10: neither cifar-10-"),
        (["--config", "/nonexistent.toml"], "error: config file /nonexistent.toml does not exist"),
        (["positional"], "error: unexpected argument 'positional'"),
    ],
)
def test_user_mistakes_give_one_line_and_exit_2(capsys, tmp_path, args, message):
    code, out, err = run_cli(capsys, *DIGITS, "--run.out", str(tmp_path / "out"), *args)
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_incompatible_explicit_members(capsys, tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[ensemble]\nmembers = [{family = "mlp", hidden = [32]}, {family = "vgg", blocks = [[8]]}]\n')
    code, _, err = run_cli(capsys, "--config", str(config), *DIGITS)
    assert code == 2 and "cannot share a mother" in err
    config.write_text('[ensemble]\nmembers = [{family = "mlp", hidden = [32], num_classes = 3}]\n')
    code, _, err = run_cli(capsys, "--config", str(config), *DIGITS)
    assert code == 2 and "num_classes 3 does not match the data's 10" in err


def test_hatched_members_reach_independent_accuracy_in_fewer_epochs(tmp_path):
    """Digits MLPs through the titan engine: members hatched from a (cheap, long-trained) mother and trained 2
    epochs match members trained 12 epochs from scratch; members trained 2 epochs from scratch are far worse."""
    overrides = {"data.dataset": "digits", "ensemble.family": "mlp", "ensemble.size": "3", "ensemble.width": "6",
                 "ensemble.spread": "1.5", "ensemble.max_depth": "2", "training.batch_size": "64",
                 "training.epochs": "12", "mothernet.mother_epochs": "24", "mothernet.hatch_epochs": "2",
                 "run.out": str(tmp_path)}
    cfg = load_config("", list(overrides.items()))
    data, members, _ = prepare(cfg)
    labels = eval_labels(data)
    mean = lambda accs: sum(accs) / len(accs)
    from_scratch = mean([r["acc"] for r in independent(cfg, data, members, labels)])
    hatched = mean(mothernets(cfg, data, members, labels)["member_acc"])
    assert hatched >= from_scratch - 1.0
    cfg.training.epochs = 2
    assert mean([r["acc"] for r in independent(cfg, data, members, labels)]) < hatched - 5.0


def test_cli_writes_results_and_plot(capsys, tmp_path):
    code, out, _ = run_cli(capsys, *DIGITS, "--sizes", "1,2", "--ensemble.family", "mlp", "--training.epochs", "1",
                           "--mothernet.mother_epochs", "1", "--mothernet.hatch_epochs", "0.5",
                           "--training.engine", "local", "--run.out", str(tmp_path))
    assert code == 0 and "mothernets" in out
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["method"], r["ensemble_size"]) for r in results] == [("mothernets", 1), ("independent", 1),
                                                                     ("mothernets", 2), ("independent", 2)]
    for r in results:
        assert set(r) >= {"method", "ensemble_size", "wall_s", "member_acc", "ensemble_acc", "train_cost"}
        assert len(r["member_acc"]) == r["ensemble_size"] and 0 <= r["ensemble_acc"] <= 100
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_json_config_gives_the_same_members_as_toml(tmp_path):
    members = [{"family": "mlp", "hidden": [64, 32]}, {"family": "mlp", "hidden": [48]}]
    (tmp_path / "c.json").write_text(json.dumps({"data": {"dataset": "digits"}, "ensemble": {"members": members}}))
    cfg = load_config(str(tmp_path / "c.json"))
    _, parsed, sizes = prepare(cfg)
    assert [a.hidden for a in parsed] == [(64, 32), (48,)] and sizes == [2]


def test_snapshots_hatch_the_members_of_a_cluster_from_successive_warm_restarts(monkeypatch, tmp_path):
    """snapshots = 2: member j hatches from snapshot j % 2, two distinct mothers; the extra cycle is paid for."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "3", "mothernet.mother_epochs": "1",
                                                      "mothernet.noise": "0", "mothernet.snapshot_epochs": "1"})
    labels = eval_labels(data)
    single = mothernets(cfg, data, members, labels)
    hatched_from = []

    def spy(mother, *args, **kw):
        hatched_from.append(mother)
        return hatch(mother, *args, **kw)

    monkeypatch.setattr(run, "hatch", spy)
    cfg.mothernet.snapshots = 2
    out = mothernets(cfg, data, members, labels)
    first, second, third = hatched_from
    assert first is third and first is not second
    assert not torch.equal(first.state_dict()["head.weight"], second.state_dict()["head.weight"])
    assert len(out["mothers"][0]["snapshot_acc"]) == 2
    cycle = 3.0 * forward_flops(mother_of(members)) * steps_for(1, data, cfg) * cfg.training.batch_size
    assert out["train_cost"] == pytest.approx(single["train_cost"] + cycle)


def test_every_training_of_a_run_reads_the_data_in_its_own_order(monkeypatch, tmp_path):
    """12 snapshots: with seed offsets, cycle 10 used to repeat hatched member 0's order."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "12", "training.epochs": "0.1",
                                                      "mothernet.mother_epochs": "0.1", "mothernet.snapshots": "12",
                                                      "mothernet.snapshot_epochs": "0.1"})
    seeds = []
    real_fit = run.fit

    def spy(net, data, cfg, epochs, lr, seed, name, solo=False):
        seeds.append(seed)
        return real_fit(net, data, cfg, epochs, lr, seed, name, solo)

    monkeypatch.setattr(run, "fit", spy)
    labels = eval_labels(data)
    independent(cfg, data, members, labels)
    mothernets(cfg, data, members, labels)
    assert len(seeds) == 12 + 12 + 12 and len(set(seeds)) == len(seeds)


def test_resnet_ensemble_from_cifar_files_through_titan(capsys, tmp_path, cifar10_batches):
    """CIFAR-10 as its binary files hold it (random pixels here), ResNet members, the titan engine end to end."""
    root, parts = cifar10_batches
    code, out, err = run_cli(capsys, "--data.dataset", "cifar10", "--data.path", str(root), "--ensemble.family",
                             "resnet", "--ensemble.blocks", "2", "--ensemble.width", "4", "--ensemble.size", "2",
                             "--training.batch_size", "8", "--training.epochs", "0.2", "--mothernet.mother_epochs",
                             "0.2", "--mothernet.hatch_epochs", "0.2", "--run.out", str(tmp_path / "out"))
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert [r["method"] for r in results] == ["mothernets", "independent"]
    assert all(len(r["member_acc"]) == 2 and 0 <= r["ensemble_acc"] <= 100 for r in results)
    assert (tmp_path / "out" / "nets" / "hatched-1-of-2" / "metrics.jsonl").exists()


def test_each_cluster_has_its_own_mother_and_snapshots(monkeypatch, tmp_path):
    """g = 2, snapshots = 2, four members: four distinct snapshot mothers, two per cluster, one per member pair."""
    cfg, data, members = tiny_mlp_ensemble(tmp_path, {"ensemble.size": "4", "mothernet.mother_epochs": "0.2",
                                                      "mothernet.snapshot_epochs": "0.2", "mothernet.clusters": "2",
                                                      "mothernet.snapshots": "2"})
    hatched_from = {}

    def spy(mother, member, **kw):
        hatched_from[members.index(member)] = mother
        return hatch(mother, member, **kw)

    monkeypatch.setattr(run, "hatch", spy)
    out = mothernets(cfg, data, members, eval_labels(data))
    assert [len(m["snapshot_acc"]) for m in out["mothers"]] == [2, 2]
    assert len({id(m) for m in hatched_from.values()}) == 4
    for mother in out["mothers"]:
        first, second = (hatched_from[i] for i in mother["members"])
        assert first.arch == mother_of([members[i] for i in mother["members"]]) == second.arch


def test_members_per_cluster_scales_g_with_the_ensemble_size(capsys, tmp_path):
    code, _, err = run_cli(capsys, *DIGITS, "--sizes", "2,5", "--ensemble.family", "mlp", "--training.engine", "local",
                           "--mothernet.members_per_cluster", "2", "--mothernet.mother_epochs", "0.2",
                           "--mothernet.hatch_epochs", "0.1", "--run.baseline", "false", "--run.out", str(tmp_path))
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["ensemble_size"], r["clusters"]) for r in results] == [(2, 1), (5, 3)]


def test_an_out_folder_under_a_file_names_run_out(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out, err = run_cli(capsys, *DIGITS, "--run.out", str(blocker / "out"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: run.out {blocker / 'out'} cannot be written") and "job.dump_folder" not in err
