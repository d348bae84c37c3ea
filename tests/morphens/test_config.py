"""The run configuration: each section refuses a value out of range in one line naming the key, and
mothernet.members_per_cluster sets g = ceil(K / members_per_cluster) at every ensemble size."""

from pathlib import Path

import pytest

from morphens.config import MotherNet, load_config
from titan.config import ConfigError


@pytest.mark.parametrize("overrides, message", [
    ({"data.dataset": "mnist"}, "data.dataset: unknown 'mnist'; choose one of digits, fashion_mnist"),
    ({"data.train_limit": "-1"}, "data.train_limit, data.test_limit and data.bootstrap must be >= 0 (0 = all"),
    ({"data.bootstrap": "-3"}, "data.train_limit, data.test_limit and data.bootstrap must be >= 0 (0 = all"),
    ({"ensemble.size": "0"}, "ensemble.size must be >= 1, got 0"),
    ({"ensemble.kernels": "3,4"}, "ensemble: conv: kernel must be a positive odd integer"),
    ({"mothernet.members_per_cluster": "-2"},
     "mothernet: clusters must be >= 1 and members_per_cluster >= 0 (0 = use clusters), got 1 and -2"),
    ({"mothernet.mother_epochs": "0"}, "mothernet.mother_epochs must be > 0 and mothernet.hatch_epochs >= 0"),
    ({"mothernet.calib_batch": "1"}, "mothernet: noise must be >= 0, calib_batch >= 2 and hatch_lr_factor > 0"),
    ({"mothernet.snapshots": "0"}, "mothernet: snapshots must be >= 1 (1 = one mother) and snapshot_epochs > 0"),
    ({"mothernet.hatch_batch_size": "1"},
     "mothernet: batch_size and hatch_batch_size must be 0 (= training.batch_size) or >= 2, lr_factor > 0"),
    ({"training.batch_size": "1"}, "training: epochs and lr must be > 0, batch_size >= 2"),
    ({"training.seed": "-1"}, "training.seed must be >= 0, got -1"),
    ({"run.sizes": "2,0"}, "run.sizes must be positive ensemble sizes, got [2, 0]"),
    ({"run.methods": "mothernets,matched_snapshot,snapshot"},
     "run.methods: matched_snapshot is sized from the mothernets and snapshot runs; list both before it"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_a_value_out_of_range_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("", list(overrides.items()))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_explicit_members_must_be_tables(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[ensemble]\nmembers = ["mlp"]\n')
    with pytest.raises(ConfigError, match=r"^ensemble.members must be a list of tables, set in the config file, got "
                                          r"\['mlp'\]$"):
        load_config(str(path))


def test_members_per_cluster_gives_the_ceiling_of_k_over_it_else_clusters():
    assert [MotherNet(members_per_cluster=3).clusters_for(k) for k in (1, 3, 4, 7)] == [1, 1, 2, 3]
    assert MotherNet(clusters=2).clusters_for(7) == 2


def test_configs_default_toml_is_what_a_plain_run_runs():
    """`python -m morphens.run` with no arguments runs configs/morphens/default.toml's values, key for key."""
    path = Path(__file__).parents[2] / "configs" / "morphens" / "default.toml"
    assert load_config(str(path)) == load_config()
