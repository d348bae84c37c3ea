"""Expert parallel in the step-time model, on the debug Qwen3-MoE cut to 2 MoE blocks and 2 x 32 tokens a rank
(dim 256, 8 experts of hidden 128, top-2, bf16 compute, fp32 gradient reduction): the dispatch and combine
all-to-alls, split by where the peers are, and the experts' own FSDP units."""

import pytest

from titan.config import parse_args
from titan.estimate.costs import Hardware
from titan.estimate.dry_run import estimate

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim")

TINY_MOE = ["--config", "configs/titan/qwen3_moe_moe_debug.toml", "--model.n_layers", "2", "--training.seq_len", "32",
            "--training.local_batch_size", "2"]
COPIES = 2 * 32 * 2 * 256 * 2  # bytes of one dispatch: 64 tokens x top-2 copies x dim 256 in bf16
EXPERT = 3 * 128 * 256  # elements of one expert's three matrices


def _rank0(world, ep, hw=None, *extra):
    cfg = parse_args([*TINY_MOE, "--comm.world_size", str(world), "--parallelism.expert_parallel_degree", str(ep),
                      *extra])
    report = estimate(cfg, hw or Hardware())
    return report, report["ranks"][0]


def _rows(rank, group):
    return [(c["op"], c["group_size"], c["calls"], c["bytes_per_call"]) for c in rank["collectives"]
            if c["group"] == group]


def test_each_moe_block_dispatches_and_combines_forward_and_backward():
    _, rank = _rank0(4, 2)
    # 2 blocks x (dispatch, combine) x (forward, backward); before each dispatch, 8 experts' int64 counts.
    assert _rows(rank, "ep") == [("all_to_all", 2, 8, COPIES), ("all_to_all", 2, 2, 64)]
    # Half of each all-to-all stays on the rank, the other half goes to the peer, in the node.
    assert rank["all_to_all_bytes"] == {"intra_node": (8 * COPIES + 2 * 64) / 2, "inter_node": 0.0}


def test_peers_outside_the_node_are_reached_over_the_network():
    # EP 4 with 2 GPUs a node: of the 4 quarters of each all-to-all, 1 stays, 1 goes to the node's other GPU and
    # 2 to the other node.
    _, rank = _rank0(8, 4, Hardware(gpus_per_node=2))
    sent = 8 * COPIES + 2 * 64
    assert rank["all_to_all_bytes"] == {"intra_node": sent / 4, "inter_node": sent / 2}
    # Both links at once: the slower share sets the time, plus the fixed cost of each call.
    bulk = next(c for c in rank["collectives"] if c["op"] == "all_to_all")
    hw = Hardware()
    assert bulk["seconds"] == pytest.approx(
        max(8 * COPIES / 4 / (hw.intra_node_gbps * 1e9), 8 * COPIES / 2 / (hw.inter_node_gbps * 1e9))
        + 8 * hw.latency_us * 1e-6)


def test_recomputed_blocks_repeat_their_forward_all_to_alls():
    _, rank = _rank0(4, 2, Hardware(), "--activation_checkpoint.mode", "full")
    assert _rows(rank, "ep") == [("all_to_all", 2, 8 + 4, COPIES), ("all_to_all", 2, 2 + 2, 64)]


def test_experts_are_fsdp_units_over_the_ranks_outside_the_expert_group():
    # World 4 = EP 2 x dp_shard_mod_ep 2: each rank computes 4 of the 8 experts, gathered from 2 shards (in
    # bf16) for forward and again for backward, their gradients reduce-scattered in fp32.
    report, rank = _rank0(4, 2)
    assert _rows(rank, "efsdp") == [("all_gather", 2, 4, 4 * EXPERT * 2), ("reduce_scatter", 2, 2, 4 * EXPERT * 4)]
    # Every dimension divides: each rank stores a quarter of the model, whether by FSDP or expert parallel.
    assert rank["memory_bytes"]["params"] == report["num_params"] * 4 / 4


def test_experts_with_no_rank_left_to_shard_them_stay_whole():
    report, rank = _rank0(2, 2)
    assert not _rows(rank, "efsdp") and rank["memory_bytes"]["params"] == report["num_params"] * 4 / 2
    # Their bf16 copies, cast each forward, are kept for backward: 2 blocks x 4 experts.
    _, fp32 = _rank0(2, 2, Hardware(), "--training.mixed_precision_param", "float32")
    bf16_gathered = rank["memory_bytes"]["gathered_params"]
    assert bf16_gathered - fp32["memory_bytes"]["gathered_params"] / 2 == 2 * 4 * EXPERT * 2


def test_expert_parallel_on_a_model_without_experts_moves_no_tokens():
    cfg = parse_args(["--model.n_layers", "2", "--comm.world_size", "2", "--parallelism.expert_parallel_degree", "2"])
    assert not [c for c in estimate(cfg, Hardware())["ranks"][0]["collectives"] if c["group"] in ("ep", "efsdp")]


# Measured on gloo ranks with --metrics.comm_stats' counter, one call at a time (benchmarks/RESULTS.md, issue 35):
# a MoE layer under TP routes its rank's sequence shard (32 of the 64 tokens) with no TP collective, and the expert
# group holds the TP ranks.
def test_moe_layers_under_tensor_x_expert_parallel_are_the_measured_ones():
    """TP 2 x EP 2 on 4 ranks: attention shards over dp_shard 2 x TP 2, each MoE layer's router is an FSDP unit
    over those 4 ranks, and its experts are split over the 2 TP ranks (4 of 8 a rank), a unit over the 2
    data-parallel ranks outside the expert group (dp_shard_mod_ep), with no TP average."""
    report, rank = _rank0(4, 2, Hardware(), "--parallelism.tensor_parallel_degree", "2")
    act = 2 * 32 * 256 * 2  # the block's activations, gathered and reduce-scattered by TP
    assert _rows(rank, "tp")[:2] == [("all_gather", 2, 6, act), ("reduce_scatter", 2, 6, act)]
    assert _rows(rank, "ep") == [("all_to_all", 2, 8, COPIES / 2), ("all_to_all", 2, 2, 64)]
    router = 8 * 256
    assert _rows(rank, "mfsdp") == [("all_gather", 4, 4, router * 2), ("reduce_scatter", 4, 2, router * 4)]
    assert _rows(rank, "efsdp") == [("all_gather", 2, 4, 4 * EXPERT * 2), ("reduce_scatter", 2, 2, 4 * EXPERT * 4)]
    fsdp = {op: calls * nbytes for op, _, calls, nbytes in _rows(rank, "fsdp")}
    assert fsdp == {"all_gather": 3 * 197_760 + 2 * 2_097_664, "reduce_scatter": 2 * 395_520 + 4_195_328}
    # What each real rank held: every parameter in quarters, the experts by expert parallel x FSDP.
    assert rank["memory_bytes"]["params"] == 4_070_144 == pytest.approx(4 * report["num_params"] / 4, rel=1e-3)


def test_full_recomputation_of_a_moe_block_repeats_its_attention_collectives():
    _, rank = _rank0(4, 2, Hardware(), "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode",
                     "full")
    assert [(op, calls) for op, _, calls, _ in _rows(rank, "tp")[:2]] == [("all_gather", 8), ("reduce_scatter", 8)]


def test_experts_under_tensor_parallel_shard_over_the_rest_of_data_parallel():
    """TP 2 x EP 4 on 8 ranks, as measured: the expert group is 2 data-parallel ranks x TP 2, whose all-to-alls
    reach the TP peer first (2 ranks a node: 1 of the 4 quarters stays, 1 goes to the TP peer, 2 to the other
    node); each rank's 2 experts are gathered from the 2 shards of dp_shard_mod_ep, their gradients
    reduce-scattered."""
    _, rank = _rank0(8, 4, Hardware(gpus_per_node=2), "--parallelism.tensor_parallel_degree", "2")
    assert _rows(rank, "ep") == [("all_to_all", 4, 8, COPIES / 2), ("all_to_all", 4, 2, 64)]
    sent = 8 * COPIES / 2 + 2 * 64
    assert rank["all_to_all_bytes"] == {"intra_node": sent / 4, "inter_node": sent / 2}
    assert _rows(rank, "efsdp") == [("all_gather", 2, 4, 2 * EXPERT * 2), ("reduce_scatter", 2, 2, 2 * EXPERT * 4)]
    assert _rows(rank, "mfsdp") == [("all_gather", 8, 4, 8 * 256 * 2), ("reduce_scatter", 8, 2, 8 * 256 * 4)]
    assert rank["memory_bytes"]["params"] == 2_035_072


def test_experts_under_hsdp_x_tensor_parallel_are_replicated_over_dp_replicate():
    """HSDP 2 x 2 x TP 2 with EP 2 and op-level SAC on 8 ranks, as measured: the experts' unit shards over
    dp_shard_mod_ep (the 2 data-parallel ranks of a replica) and all-reduces its shards over the replicas; the
    routers' units all-reduce their shards over the replicas too."""
    _, rank = _rank0(8, 2, Hardware(), "--parallelism.tensor_parallel_degree", "2",
                     "--parallelism.data_parallel_replicate_degree", "2", "--activation_checkpoint.mode", "selective",
                     "--activation_checkpoint.selective_ac_option", "op")
    assert _rows(rank, "efsdp") == [("all_gather", 2, 4, 4 * EXPERT * 2), ("reduce_scatter", 2, 2, 4 * EXPERT * 4)]
    assert _rows(rank, "ehsdp") == [("all_reduce", 2, 2, 2 * EXPERT * 4)]
    assert _rows(rank, "mhsdp") == [("all_reduce", 2, 2, 8 * 256 // 4 * 4)]
    # The op policy saves the reduce-scatters' outputs and the all-to-alls, but not the gathers.
    assert [calls for op, _, calls, _ in _rows(rank, "tp")[:2]] == [8, 6]
    assert [calls for *_, calls, _ in _rows(rank, "ep")] == [8, 2]
    assert rank["memory_bytes"]["params"] == 4_070_144


def test_experts_split_over_the_tp_ranks_alone_stay_whole_on_them():
    """EP 2 x TP 2 on 2 ranks, as measured: the expert group is the TP ranks, no rank is left to shard the experts
    (4 of 8 a rank) over, and the routers' units over TP gather in fp32 (no other FSDP: the forward autocasts)."""
    report, rank = _rank0(2, 2, Hardware(), "--parallelism.tensor_parallel_degree", "2")
    assert _rows(rank, "ep") == [("all_to_all", 2, 8, COPIES / 2), ("all_to_all", 2, 2, 64)]
    assert not _rows(rank, "efsdp") and not _rows(rank, "fsdp")
    assert _rows(rank, "mfsdp") == [("all_gather", 2, 4, 8 * 256 * 4), ("reduce_scatter", 2, 2, 8 * 256 * 4)]
    assert rank["memory_bytes"]["params"] == 8_140_288 == pytest.approx(4 * report["num_params"] / 2, rel=1e-3)


def test_moe_layers_under_tensor_parallel_alone_are_fsdp_units_over_it():
    """TP 2 on 2 ranks, no data parallel: each MoE layer (router and 8 experts) is whole on both ranks, gathered
    in fp32 (no other FSDP, so the forward autocasts) for forward and backward."""
    _, rank = _rank0(2, 1, Hardware(), "--parallelism.tensor_parallel_degree", "2")
    layer = (8 * 256 + 8 * EXPERT) * 4
    assert _rows(rank, "mfsdp") == [("all_gather", 2, 4, layer), ("reduce_scatter", 2, 2, layer)]
    assert rank["memory_bytes"]["params"] == 8_140_288


def test_routing_imbalance_slows_and_grows_the_busiest_expert_rank():
    """--estimate.moe_imbalance 1.3, an input: the busiest rank of EP 2 receives 1.3 x the balanced copies, computes
    them (k = 2 experts' three matrices a copy, 2 blocks x 64 tokens) and keeps their grouped-GEMM activations."""
    hw = Hardware(peak_tflops=1.0)
    _, balanced = _rank0(4, 2, hw)
    _, busy = _rank0(4, 2, Hardware(peak_tflops=1.0, moe_imbalance=1.3))
    assert _rows(busy, "ep") == [("all_to_all", 2, 8, pytest.approx(1.3 * COPIES)), ("all_to_all", 2, 2, 64)]
    routed_flops = 6 * 2 * EXPERT * 2 * 64
    assert busy["compute_s_per_microbatch"] - balanced["compute_s_per_microbatch"] == pytest.approx(
        0.3 * routed_flops / (1e12 * hw.mfu))
    extra = busy["memory_bytes"]["activations"] - balanced["memory_bytes"]["activations"]
    assert extra == pytest.approx(0.3 * 2 * (256 + 4 * 128) * 64 * 2 * 2)  # k x (input + 4 hidden) x tokens x bf16
    # The same FLOPs count towards MFU: the busiest rank's extra work is waiting, not model FLOPs.
    assert busy["model_flops_per_microbatch"] == balanced["model_flops_per_microbatch"]


def test_without_expert_parallel_imbalance_changes_nothing():
    # Every rank computes all k copies of its own tokens, however they are routed.
    balanced, busy = (_rank0(2, 1, Hardware(moe_imbalance=m))[1] for m in (1.0, 1.5))
    assert busy == balanced
