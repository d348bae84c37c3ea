"""`python -m morphens.run`: its user-mistake contract and what a run writes."""

import json

import pytest
from tests.conftest import assert_is_plot

from morphens.run import main

DIGITS = ["--data.dataset", "digits", "--training.batch_size", "64"]


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.epochs", "many"], "error: training.epochs must be a number, got 'many'"),
        (["--training.engine", "jax"], "error: training.engine must be one of 'titan', 'local', got 'jax'"),
        (["--optimizer.lr", "1"], "error: unknown config section [optimizer]"),
        (["--training.learning_rate", "1"], "error: unknown key training.learning_rate"),
        (["--ensemble.family", "densenet"], "error: ensemble: family 'densenet' is unknown; choose vgg"),
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


def test_cli_writes_results_and_plot(capsys, tmp_path):
    code, out, _ = run_cli(capsys, *DIGITS, "--sizes", "1,2", "--ensemble.family", "mlp", "--training.epochs", "1",
                           "--mothernet.mother_epochs", "1", "--mothernet.hatch_epochs", "0.5",
                           "--training.engine", "local", "--run.out", str(tmp_path))
    assert code == 0 and "mothernets" in out
    # each size's baseline members train beside its MotherNets, so that host drift moves both sides of a ratio
    assert out.index("K=1:") < out.index("independent 0:") < out.index("K=2:") < out.index("independent 1:")
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["method"], r["ensemble_size"]) for r in results] == [("mothernets", 1), ("independent", 1),
                                                                     ("mothernets", 2), ("independent", 2)]
    for r in results:
        assert set(r) >= {"method", "ensemble_size", "wall_s", "member_acc", "ensemble_acc", "train_cost"}
        assert r["elapsed_s"] > r["wall_s"]  # in one process: the training that wall_s counts, and evaluation
        assert len(r["member_acc"]) == r["ensemble_size"] and 0 <= r["ensemble_acc"] <= 100
        if r["ensemble_size"] == 1:  # the average of one member's softmax is its own
            assert r["ensemble_acc"] == r["member_acc"][0]
    assert_is_plot(tmp_path / "results.png")
    mothernets, independent = results[2:]
    *_, line = out.strip().splitlines()
    assert line.startswith("done: 4 ensembles in "), line
    assert line.endswith(f", K=2 ensemble accuracy mothernets {mothernets['ensemble_acc']:.2f}% "
                         f"({mothernets['speedup']['wall']:.2f}x less wall time), independent "
                         f"{independent['ensemble_acc']:.2f}%, outputs in {tmp_path} (results.json, results.png)")


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


def test_members_per_cluster_scales_g_with_the_ensemble_size(capsys, tmp_path):
    code, _, err = run_cli(capsys, *DIGITS, "--sizes", "2,5", "--ensemble.family", "mlp", "--training.engine", "local",
                           "--mothernet.members_per_cluster", "2", "--mothernet.mother_epochs", "0.2",
                           "--mothernet.hatch_epochs", "0.1", "--run.methods", "mothernets", "--run.out", str(tmp_path))
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["ensemble_size"], r["clusters"]) for r in results] == [(2, 1), (5, 3)]


def test_an_out_folder_under_a_file_names_run_out(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out, err = run_cli(capsys, *DIGITS, "--run.out", str(blocker / "out"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: run.out {blocker / 'out'} cannot be written") and "job.dump_folder" not in err


def test_quick_runs_all_three_methods_on_digits_and_later_options_override_it(capsys, tmp_path):
    code, out, err = run_cli(capsys, "--quick", "--ensemble.size", "2", "--run.out", str(tmp_path))
    assert code == 0, err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["method"], r["ensemble_size"], r["device"]) for r in results] == [
        ("mothernets", 2, "cpu"), ("independent", 2, "cpu"), ("snapshot", 2, "cpu")]
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert config["data"]["dataset"] == "digits" and config["training"]["engine"] == "local"
