"""Tensor parallel on the decoders with experts or latent attention gives the one-process run: 3 AdamW steps (fp32)
with the same losses and gradient norms (1e-5), the same balancing biases and token-count metrics after them.

Layouts: TP 2 of Qwen3-MoE (GQA with QK-norm, a dense first block, the router's auxiliary loss) and of DeepSeek-V3
(MLA with and without a query latent, a dense first block, shared experts, group-limited routing); EP 2 x TP 2 of
both on 2 ranks, EP 4 x FSDP 2 x TP 2 of DeepSeek-V3, FSDP 2 x TP 2 and EP 2 x FSDP 2 x TP 2 of Qwen3-MoE on 4 ranks
(the expert group holds the TP ranks). Each layout goes through the family's parallelize function.
Under TP each rank's MoE routes its own sequence shard, so Qwen3-MoE's auxiliary loss (over all the model's layers
at once) is the mean of per-shard losses, as under data parallel: the reference computes it so, shard by shard.
DeepSeek-V3's sequence-wise balance loss counts each sequence over the TP ranks holding its shards: its reference
is the plain one-process model."""

import os
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.launch import run_module
from tests.titan.distributed.test_expert_parallel_model import TOKENS_PER_RANK, _batch, _train


@dataclass(frozen=True)
class Layout:
    name: str
    family: str
    world: int
    tp: int = 2
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world // self.tp


LAYOUTS = [Layout("tp2-qwen3-moe", "qwen3_moe", 2), Layout("tp2-deepseek-v3", "deepseek_v3", 2),
           Layout("tp2-deepseek-v3-q-lora", "deepseek_v3_q_lora", 2),
           # The expert group is the TP ranks: each holds half the experts, no data parallel beside them.
           Layout("ep2-tp2-deepseek-v3", "deepseek_v3", 2, ep=2), Layout("ep2-tp2-qwen3-moe", "qwen3_moe", 2, ep=2),
           Layout("fsdp2-tp2-qwen3-moe", "qwen3_moe", 4),
           # The expert group is all 4 ranks (2 of data parallel x TP 2): no FSDP unit for the experts.
           Layout("ep4-fsdp2-tp2-deepseek-v3", "deepseek_v3", 4, ep=4),
           # The experts split over the TP ranks, FSDP over the 2 data-parallel ranks outside the expert group.
           Layout("ep2-fsdp2-tp2-qwen3-moe", "qwen3_moe", 4, ep=2),
           # Both: expert group 2 of data parallel x TP 2, the experts' FSDP over the other 2.
           Layout("ep4-fsdp4-tp2-deepseek-v3", "deepseek_v3", 8, ep=4)]


def _model(family: str):
    from titan.models.deepseek_v3.model import ModelArgs, Transformer
    from titan.models.qwen3_moe.model import Qwen3MoeDecoder, Qwen3MoeModelArgs

    if family == "qwen3_moe":
        model_cls, args = Qwen3MoeDecoder, Qwen3MoeModelArgs(
            dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, moe_hidden_dim=16, num_experts=8,
            top_k=2, mlp_only_layers=[0], aux_loss_coef=0.1, vocab_size=64, max_seq_len=16)
    else:
        model_cls, args = Transformer, ModelArgs(
            dim=32, n_layers=3, n_dense_layers=1, n_heads=2, vocab_size=64, inter_dim=64, moe_inter_dim=16,
            n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1,
            q_lora_rank=16 if family.endswith("q_lora") else 0, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, rope_factor=1.0, rope_mscale=0.0, rope_mscale_all_dim=0.0,
            max_seq_len=16, bias_update_rate=1e-2, seq_aux_loss_alpha=0.5)
    torch.manual_seed(0)
    model = model_cls(args)
    model.init_weights()
    return model


def _route_by_shard(model, dp: int, tp: int) -> None:
    """Makes every MoE layer of a one-process model route each data-parallel rank's rows and each TP rank's
    sequence shard on its own, and the model add each shard's auxiliary loss over all its layers, weighted
    1 / shards, as the layout does."""
    from titan.models.common.moe import MoE
    from titan.models.common.moe_balance import add_balance_loss

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    shard_stats = {moe: [] for moe in layers}  # each layer's records, shard by shard
    for moe in layers:
        moe.aux_loss_scale = 1 / (dp * tp)

        def route(x, moe=moe, forward=moe.forward):
            out = forward(x)
            shard_stats[moe].append(moe.balance_stats)
            moe.balance_stats = None  # the model's own add_balance_loss sees none
            return out
        moe.forward = lambda x, route=route: torch.cat(
            [torch.cat([route(part) for part in rows.chunk(tp, dim=1)], dim=1) for rows in x.chunk(dp)])
    model_forward = model.forward

    def forward(tokens):
        out = model_forward(tokens)
        for shard in range(dp * tp):
            for moe in layers:
                moe.balance_stats = shard_stats[moe][shard]
            out = add_balance_loss(out, layers)
        for stats in shard_stats.values():
            stats.clear()
        return out
    model.forward = forward


def _run(layout: Layout) -> dict:
    from titan.config import parse_args
    from titan.distributed import ParallelDims
    from titan.models.common.moe import MoE
    from titan.models.common.moe_balance import set_aux_loss_scale
    from titan.models.common.moe_load import expert_load_step
    from titan.models.common.parallelize import parallelize_decoder

    reference = _model(layout.family)
    if layout.family == "qwen3_moe":
        _route_by_shard(reference, layout.dp, layout.tp)
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=layout.tp, pp=1, world_size=layout.world,
                        ep=layout.ep)
    dims.build_mesh("cpu")
    config = parse_args(["--training.mixed_precision_param", "float32", "--parallelism.enable_loss_parallel", "false"])
    model = parallelize_decoder(_model(layout.family), dims, config)
    set_aux_loss_scale([model], 1.0, cp_tp_group=dims.submesh("cp_tp").get_group())  # as the trainer does
    group = dims.submesh("dp_cp_tp").get_group()
    B, d = TOKENS_PER_RANK[0], dims.dp_rank()
    records = {"reference": _train(reference, lambda step: _batch(step, layout.dp)),
               "got": _train(model, lambda step: _batch(step, layout.dp)[d * B:(d + 1) * B], group=group)}
    # One more forward: the token counts it leaves, summed over the ranks, are those of the whole batch.
    tokens = _batch(3, layout.dp)[:, :-1]
    with torch.no_grad():
        reference(tokens), model(tokens[d * B:(d + 1) * B])
    for key, m in (("reference", reference), ("got", model)):
        load = expert_load_step(m, group if key == "got" else None)
        records[f"{key}_load"] = {k: v.item() for k, v in load.items()}
        records[f"{key}_bias"] = torch.stack([x.router.expert_bias for x in m.modules() if isinstance(x, MoE)])
    return records


def _worker(world: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {layout.name: _run(layout) for layout in LAYOUTS if layout.world == world}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One launch per world size, all its layouts in it (start-up dominates)."""
    results = {}

    def get(world: int) -> dict:
        if world not in results:
            out = tmp_path_factory.mktemp(f"world{world}") / "results.pt"
            proc = run_module("tests.titan.models.common.test_parallelize_sparse", [str(world), str(out)],
                              os.environ | {"OMP_NUM_THREADS": "1"}, nproc=world, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            results[world] = torch.load(out, weights_only=True)
        return results[world]

    return get


@pytest.mark.parametrize("layout", [pytest.param(layout, id=layout.name, marks=[pytest.mark.slow] * (layout.world > 4))
                                    for layout in LAYOUTS])
def test_tensor_parallel_training_equals_one_process(launches, layout):
    result = launches(layout.world)[layout.name]
    for (loss, norm), (want_loss, want_norm) in zip(result["got"], result["reference"], strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    assert result["got_load"] == pytest.approx(result["reference_load"], rel=1e-6)
    torch.testing.assert_close(result["got_bias"], result["reference_bias"], rtol=0, atol=1e-6)
    if layout.family.startswith("deepseek_v3"):
        assert result["got_bias"].abs().sum() > 0  # the auxiliary-loss-free update ran


@pytest.mark.parametrize("family, tp, message", [
    ("deepseek_v3", 3, "tensor_parallel_degree 3 must divide n_heads 8$"),
    ("qwen3_moe", 8, "tensor_parallel_degree 8 must divide n_heads 8 and n_kv_heads 4$")])
def test_a_tp_degree_that_does_not_divide_the_heads_is_one_error_line(family, tp, message):
    from titan.config import parse_args
    from titan.distributed import ParallelDims
    from titan.models import get_model_spec
    from titan.tools.cli import UserError

    spec = get_model_spec(family)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, world_size=tp)
    with pytest.raises(UserError, match=message):
        spec.check_layout(spec.flavors["debug"], dims, parse_args([]))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
