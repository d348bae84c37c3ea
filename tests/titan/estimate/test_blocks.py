"""What the step-time model reads of one block: a GQA block's weights, and the activations a block saves for
backward, checked against what the layers really save (torch.autograd.graph.saved_tensors_hooks)."""

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan.estimate.blocks import block_activation_elems, estimable, layer_params, moe_activation_elems
from titan.estimate.layout import fake_process_group
from titan.models import get_model_spec
from titan.models.common.decoder import TransformerBlock
from titan.models.common.moe import MoE, MoEArgs
from titan.models.common.parallelize import apply_tp
from titan.models.deepseek_v3 import deepseek_v3_flavors
from titan.models.llama3 import llama3_flavors
from titan.models.qwen3 import qwen3_flavors
from titan.models.qwen3_moe import qwen3_moe_flavors


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


def _storage(t: torch.Tensor):
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def _saved_elems_per_token(module, x, *inputs) -> float:
    """bf16 elements per token of the tensors `module`'s forward saves for backward, each storage once (a DTensor's
    local one), without its input and its parameters."""
    skip = {_storage(p).data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if _storage(t).data_ptr() not in skip:
            saved[_storage(t).data_ptr()] = _storage(t).nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, *inputs)
    return sum(saved.values()) / 2 / x.shape[:-1].numel()


@pytest.mark.parametrize("moe_args", [
    MoEArgs(num_experts=8, top_k=2, hidden_dim=128),  # Qwen3-MoE's routing
    MoEArgs(num_experts=16, top_k=4, hidden_dim=64, num_shared_experts=2, score_func="sigmoid", n_groups=4,
            topk_groups=2, route_norm=True),  # DeepSeek-V3's
], ids=["softmax", "sigmoid-shared"])
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_moe_activations_are_what_the_layer_saves(moe_args, grouped_mm):
    torch.manual_seed(0)
    moe_args.use_grouped_mm = grouped_mm
    moe = MoE(256, moe_args).to(torch.bfloat16)
    moe.init_weights(0.02)
    x = torch.randn(2, 2048, 256, dtype=torch.bfloat16, requires_grad=True)
    # Within 1%: the router's weight, cast to fp32 once a layer, is not per token.
    assert _saved_elems_per_token(moe, x) == pytest.approx(moe_activation_elems(moe_args, 256), rel=0.01)


def test_the_experts_of_a_busier_rank_save_more_and_the_rest_as_balanced():
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=128)
    extra = moe_activation_elems(args, 256, load=1.5) - moe_activation_elems(args, 256)
    assert extra == 0.5 * 2 * (256 + 4 * 128)  # k copies' grouped-GEMM input and its four hidden outputs


@pytest.mark.parametrize("name, layer", [("qwen3_moe", "0"), ("deepseek_v3", "1")], ids=["gqa", "mla"])
def test_a_moe_block_under_tensor_parallel_saves_its_heads_and_sequence_shard(name, layer):
    """A MoE block of the debug flavors (2 x 128 tokens), whole and under TP 2 (rank 0 of a fake process group, real
    tensors): the MoE layer saves for its rank's half of the tokens, attention for its half of the heads, so the
    estimate keeps its ratio to what the block saves (about 0.85 whole: it is not exact on attention)."""
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors["debug"], n_layers=2)
    ratios = []
    for tp in (1, 2):
        torch.manual_seed(0)
        with fake_process_group(0, tp):
            model = spec.build_model(args).to(torch.bfloat16)
            if tp > 1:
                apply_tp(model, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)), False)
            x = torch.randn(2, 128 // tp, args.dim, dtype=torch.bfloat16, requires_grad=True)
            saved = _saved_elems_per_token(model.layers[layer], x, model.rope_cache) / tp
        ratios.append(block_activation_elems(args, tp, "none", moe=True) / saved)
    assert ratios[1] == pytest.approx(ratios[0], rel=0.05)


def test_an_moe_block_saves_more_than_a_dense_one_and_checkpointing_keeps_its_input():
    args = deepseek_v3_flavors["671B"]
    dense, moe = (block_activation_elems(args, 1, "none", moe=m) for m in (False, True))
    assert dense < moe
    assert block_activation_elems(args, 1, "full", moe=True) == args.dim
    assert args.dim < block_activation_elems(args, 1, "op", moe=True) < moe


@pytest.mark.parametrize("args, expected", [
    (llama3_flavors["8B"], True), (qwen3_moe_flavors["235B-A22B"], True), (deepseek_v3_flavors["671B"], True),
    (None, False), (MoEArgs(), False),
], ids=["llama3", "qwen3_moe", "deepseek_v3", "no flavor", "another shape"])
def test_the_model_knows_gqa_and_latent_attention_decoders(args, expected):
    assert estimable(args) is expected
