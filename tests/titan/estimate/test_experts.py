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
