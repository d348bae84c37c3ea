"""The estimator's analytical costs: the hardware assumptions' checks and the collectives a rank issues."""

import pytest

from titan.config import parse_args
from titan.estimate.costs import Hardware
from titan.estimate.dry_run import estimate

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim")


@pytest.mark.parametrize("key, value, message", [("mfu", 0.0, "estimate.mfu must be > 0, got 0.0"),
                                                 ("peak_tflops", -1.0, "estimate.peak_tflops must be >= 0"),
                                                 ("moe_imbalance", 0.8, "estimate.moe_imbalance is max / mean")])
def test_a_hardware_assumption_out_of_range_names_its_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        Hardware(**{key: value})


@pytest.mark.parametrize("ac, gathers, scatters", [
    (["none"], 10, 10),
    (["full"], 14, 12),  # recomputation stops before each block's MLP reduce-scatter
    (["selective", "--activation_checkpoint.selective_ac_option", "op"], 14, 10),  # the policy saves them
    (["selective", "--activation_checkpoint.selective_ac_option", "1"], 14, 12),
])
def test_tp_collectives_with_recomputation_are_the_measured_ones(ac, gathers, scatters):
    """Counts measured with --metrics.comm_stats on 2 gloo ranks (debug model, 2 layers, TP 2)."""
    cfg = parse_args(["--comm.world_size", "2", "--model.n_layers", "2", "--parallelism.tensor_parallel_degree", "2",
                      "--activation_checkpoint.mode", *ac])
    calls = {c["op"]: c["calls"] for c in estimate(cfg, Hardware())["ranks"][0]["collectives"] if c["group"] == "tp"}
    assert (calls["all_gather"], calls["reduce_scatter"]) == (gathers, scatters)
