"""The estimator's analytical costs: per-layer weights, saved activations, the hardware assumptions' checks and the
collectives a rank issues."""

import pytest
import torch

from titan.config import parse_args
from titan.estimate.costs import Hardware, block_activation_elems, layer_params
from titan.estimate.dry_run import estimate
from titan.models.common.decoder import TransformerBlock
from titan.models.llama3 import llama3_flavors
from titan.models.qwen3 import qwen3_flavors

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim")


@pytest.mark.parametrize("args", [llama3_flavors["8B"], llama3_flavors["3.2-1B"], qwen3_flavors["32B"]],
                         ids=["llama3-8B", "llama3-3.2-1B", "qwen3-32B"])
def test_layer_params_are_the_weights_of_one_transformer_block(args):
    with torch.device("meta"):
        block = TransformerBlock(0, args)
    shapes = {name.rsplit(".", 2)[-2]: p.numel() for name, p in block.named_parameters() if "norm" not in name}
    assert {k: v for k, v in layer_params(args).items() if k != "norms"} == shapes
    assert sum(layer_params(args).values()) == sum(p.numel() for p in block.parameters())


def test_full_checkpointing_saves_only_the_block_input_sharded_over_tp():
    args = llama3_flavors["8B"]
    assert block_activation_elems(args, tp=4, kind="full") == 4096 / 4
    assert block_activation_elems(args, tp=1, kind="op") < block_activation_elems(args, tp=1, kind="none")


@pytest.mark.parametrize("key, value, message", [("mfu", 0.0, "estimate.mfu must be > 0, got 0.0"),
                                                 ("peak_tflops", -1.0, "estimate.peak_tflops must be >= 0")])
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
