"""Ranks never disagree about a checkpoint: rank 0 chooses the step every rank loads, and a problem that only one
rank sees (a lagging listing, a shard that reads back changed, unreadable metadata) is every rank's: all fall back
together, or all stop with the same line. Two real gloo ranks; rank 1 alone sees the folder differently."""

import pytest

from tests.launch import run_ranks

MODULE = "tests.titan.components.checkpoint.agreement_ranks"


def run(tmp_path, scenario):
    return run_ranks(MODULE, [str(tmp_path / "ckpt"), scenario], tmp_path / "out")


def test_every_rank_loads_the_step_rank_0_chose_though_rank_1_lists_fewer(tmp_path):
    ranks = run(tmp_path, "listing")
    assert [(r["step"], r["weight"]) for r in ranks] == [(2, 2.0), (2, 2.0)]


@pytest.mark.parametrize("scenario", ["shard", "metadata"])
def test_a_problem_one_rank_sees_makes_every_rank_fall_back_with_the_same_warning(tmp_path, scenario):
    ranks = run(tmp_path, scenario)
    assert [(r["step"], r["weight"]) for r in ranks] == [(1, 1.0), (1, 1.0)]
    assert len(ranks[0]["warnings"]) == 1 and ranks[0]["warnings"] == ranks[1]["warnings"]
    assert "step-2" in ranks[0]["warnings"][0]


def test_an_explicit_step_one_rank_finds_damaged_stops_every_rank_with_the_same_line(tmp_path):
    ranks = run(tmp_path, "shard_step2")
    assert "step" not in ranks[0] and ranks[0]["error"] == ranks[1]["error"]
    assert "step-2: shard" in ranks[0]["error"] and "checksum" in ranks[0]["error"]
