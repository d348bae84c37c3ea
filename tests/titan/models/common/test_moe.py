"""The MoE layer against transformers' Qwen3-MoE and DeepSeek-V3 blocks (random small configs, float64, our weights
copied in), the grouped GEMM against the per-expert loop, and the load-balancing machinery."""

import pytest
import torch

from titan.models.common.moe import MoE, MoEArgs
from titan.models.common.moe_balance import load_balancing_loss
from titan.models.common.moe_load import expert_load_step
from titan.tools.cli import UserError

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    Qwen3MoeSparseMoeBlock,
    load_balancing_loss_func,
)

DIM, HIDDEN = 32, 16


def _randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.3)


def _copy_experts(ours: MoE, experts) -> None:
    with torch.no_grad():
        ours.experts.w1.copy_(experts.gate_up_proj[:, :HIDDEN])
        ours.experts.w3.copy_(experts.gate_up_proj[:, HIDDEN:])
        ours.experts.w2.copy_(experts.down_proj)


def qwen3_pair(num_experts=8, top_k=2, norm_topk_prob=True, seed=0):
    cfg = transformers.Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=HIDDEN, num_experts=num_experts,
                                      num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    theirs = Qwen3MoeSparseMoeBlock(cfg).to(torch.float64)
    _randomize(theirs, seed)
    ours = MoE(DIM, MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=HIDDEN,
                            route_norm=norm_topk_prob)).to(torch.float64)
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
    _copy_experts(ours, theirs.experts)
    return ours, theirs


def deepseek_pair(n_group=4, topk_group=2, top_k=3, seed=0):
    cfg = transformers.DeepseekV3Config(hidden_size=DIM, moe_intermediate_size=HIDDEN, n_routed_experts=16,
                                        num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                                        n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = DeepseekV3MoE(cfg).to(torch.float64)
    _randomize(theirs, seed)
    # The router runs in float32 there, on float32 weights: keep them float32-representable.
    theirs.gate.weight.data = theirs.gate.weight.data.float()
    theirs.gate.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(seed)) * 0.1)
    ours = MoE(DIM, MoEArgs(num_experts=16, top_k=top_k, hidden_dim=HIDDEN, num_shared_experts=2,
                            score_func="sigmoid", route_norm=True, route_scale=2.5, n_groups=n_group,
                            topk_groups=topk_group)).to(torch.float64)
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.router.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        shared = ours.shared_experts
        shared.w1.weight.copy_(theirs.shared_experts.gate_proj.weight)
        shared.w3.weight.copy_(theirs.shared_experts.up_proj.weight)
        shared.w2.weight.copy_(theirs.shared_experts.down_proj.weight)
    _copy_experts(ours, theirs.experts)
    return ours, theirs


def _inputs(seed=1, tokens=24):
    return torch.randn(2, tokens // 2, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _assert_rel(got, want, rtol=1e-6):
    err = ((got - want).norm() / want.norm()).item()
    assert err < rtol, err


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_matches_transformers(norm_topk_prob):
    ours, theirs = qwen3_pair(norm_topk_prob=norm_topk_prob)
    x = _inputs()
    _assert_rel(ours(x), theirs(x))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_qwen3_moe_block_gradients_match_transformers(grouped):
    """The input's, the router's (through the routing weights only) and the experts' gradients: what the token
    copies' gathers and the weighted sum give back in backward."""
    ours, theirs = qwen3_pair(top_k=3)
    ours.experts.use_grouped_mm = grouped
    x = _inputs()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(got).backward(grad)
    theirs(want).backward(grad)
    gate_up, down = theirs.experts.gate_up_proj.grad, theirs.experts.down_proj.grad
    for a, b in [(got.grad, want.grad), (ours.router.gate.weight.grad, theirs.gate.weight.grad),
                 (ours.experts.w1.grad, gate_up[:, :HIDDEN]), (ours.experts.w3.grad, gate_up[:, HIDDEN:]),
                 (ours.experts.w2.grad, down)]:
        _assert_rel(a, b)


def test_deepseek_v3_moe_matches_transformers_with_group_limited_routing_and_bias():
    ours, theirs = deepseek_pair()
    x = _inputs()
    _assert_rel(ours(x), theirs(x))
    # The selection bias changes which experts are picked: without it the output differs.
    ours.router.expert_bias.zero_()
    assert ((ours(x) - theirs(x)).norm() / theirs(x).norm()).item() > 1e-3


def test_deepseek_v3_without_groups_matches_transformers():
    ours, theirs = deepseek_pair(n_group=1, topk_group=1, top_k=4, seed=3)
    x = _inputs(seed=4)
    _assert_rel(ours(x), theirs(x))


def test_router_ties_are_broken_as_transformers_breaks_them():
    """Experts in twins with identical gate rows score exactly the same for every token; with an odd k one twin of a
    pair is picked and the other not, by the tie-break."""
    for pair in (lambda: qwen3_pair(top_k=3), deepseek_pair):
        ours, theirs = pair()
        with torch.no_grad():
            for gate in (ours.router.gate, theirs.gate):
                gate.weight[1::2] = gate.weight[0::2]
            if ours.args.score_func == "sigmoid":
                for bias in (ours.router.expert_bias, theirs.gate.e_score_correction_bias):
                    bias[1::2] = bias[0::2]
        x = _inputs(seed=5)
        _assert_rel(ours(x), theirs(x))


def test_grouped_mm_equals_the_per_expert_loop_in_fp32_forward_and_backward():
    ours, _ = deepseek_pair()
    ours = ours.float()
    x = _inputs().float()
    # One expert gets no token at all: the grouped GEMM's empty groups must work too.
    with torch.no_grad():
        ours.router.expert_bias[5] = -100.0
    results = []
    for grouped in (True, False):
        ours.zero_grad()
        ours.experts.use_grouped_mm = grouped
        xg = x.clone().requires_grad_()
        y = ours(xg)
        y.sum().backward()  # an expanded gradient, which the grouped GEMM needs made contiguous
        results.append([y, xg.grad, *(p.grad for p in ours.experts.parameters())])
    assert ours.tokens_per_expert[5] == 0
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_qwen3_balance_loss_is_transformers_over_all_layers_concatenated_or_summed_per_layer():
    """Three layers' router logits with different loads. By default one loss over all of them (transformers');
    per_layer: the sum of transformers' loss of each layer alone (Switch's, TorchTitan's), not their mean."""
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(64, 8, generator=generator, dtype=torch.float64) * s for s in (0.5, 1.0, 3.0))
    probs = [x.softmax(dim=-1) for x in logits]
    counts = [torch.bincount(p.topk(2, dim=-1).indices.flatten(), minlength=8) for p in probs]
    prob_sums = torch.stack([p.sum(dim=0) for p in probs])
    got = load_balancing_loss(prob_sums, torch.stack(counts), 64)
    want = load_balancing_loss_func(logits, num_experts=8, top_k=2)  # float32 there
    torch.testing.assert_close(got, want.to(torch.float64), rtol=1e-6, atol=0)
    per_layer = load_balancing_loss(prob_sums, torch.stack(counts), 64, per_layer=True)
    want = sum(load_balancing_loss_func((x,), num_experts=8, top_k=2) for x in logits)
    torch.testing.assert_close(per_layer, want.to(torch.float64), rtol=1e-6, atol=0)
    assert abs(per_layer / 3 - got) > 1e-3


def test_moe_records_its_routing_for_the_balance_loss_only_in_training():
    ours, _ = qwen3_pair()
    ours.args.aux_loss_coef = 0.5
    x = _inputs()
    ours.eval()
    ours(x)
    assert ours.balance_stats is None
    ours.train()
    with torch.no_grad():
        ours(x)
    assert ours.balance_stats is None
    ours(x)
    prob_sums, counts, tokens = ours.balance_stats
    assert tokens == x.shape[0] * x.shape[1] and counts.sum() == 2 * tokens
    assert prob_sums.requires_grad
    torch.testing.assert_close(prob_sums.sum().item(), float(tokens))


def test_expert_load_step_reports_load_and_moves_the_bias_towards_balance():
    ours, _ = deepseek_pair()
    ours.args.bias_update_rate = 0.01
    ours.tokens_per_expert.zero_()
    bias = ours.router.expert_bias.clone()
    x = _inputs(tokens=64)
    with torch.no_grad():
        ours(x)
        ours(x)  # counts add up over micro-batches
    counts = ours.tokens_per_expert.clone()
    assert counts.sum() == 2 * 64 * 3
    stats = {k: v.item() for k, v in expert_load_step(ours).items()}
    imbalance = pytest.approx((counts.max() / counts.mean()).item())
    assert stats == {"moe_tokens_min": counts.min().item(), "moe_tokens_max": counts.max().item(),
                     "moe_imbalance": imbalance, "moe_imbalance_all_layers": imbalance}  # one layer
    step = ours.router.expert_bias - bias
    assert torch.allclose(step, 0.01 * torch.sign(counts.mean() - counts).double())
    assert ours.tokens_per_expert.sum() == 0
    assert expert_load_step(torch.nn.Linear(2, 2)) == {}


def test_expert_load_reports_the_worst_layer_and_the_experts_summed_over_layers():
    """Two layers skewed in opposite directions: each layer's imbalance is 1.5 (its busiest expert takes 1.5x the
    mean), the experts' counts summed over the layers are even (1.0), what the all-layer balance loss balances."""
    layers = torch.nn.ModuleList(MoE(DIM, MoEArgs(num_experts=4, top_k=1, hidden_dim=HIDDEN)) for _ in range(2))
    layers[0].tokens_per_expert.copy_(torch.tensor([6.0, 4.0, 4.0, 2.0]))
    layers[1].tokens_per_expert.copy_(torch.tensor([2.0, 4.0, 4.0, 6.0]))
    stats = {k: v.item() for k, v in expert_load_step(layers).items()}
    assert stats == {"moe_tokens_min": 2, "moe_tokens_max": 6, "moe_imbalance": 1.5, "moe_imbalance_all_layers": 1.0}


@pytest.mark.parametrize("kwargs", [dict(top_k=9), dict(n_groups=3), dict(n_groups=4, topk_groups=5),
                                    dict(score_func="relu"), dict(n_groups=8, topk_groups=2),
                                    dict(n_groups=4, topk_groups=1, top_k=3), dict(balance_loss="per_expert")])
def test_impossible_moe_args_are_user_errors(kwargs):
    with pytest.raises(UserError):
        MoEArgs(**{"num_experts": 8, **kwargs})


def test_activation_checkpoint_recompute_does_not_count_tokens_twice():
    from torch.utils.checkpoint import checkpoint

    ours, _ = deepseek_pair()
    ours.tokens_per_expert.zero_()
    x = _inputs().requires_grad_()
    checkpoint(ours, x, use_reentrant=False).sum().backward()
    assert ours.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 3


def test_evaluation_does_not_count_tokens():
    """Validation between steps must not move the balancing biases."""
    ours, _ = deepseek_pair()
    ours.tokens_per_expert.zero_()
    with torch.no_grad():
        ours.eval()(_inputs())
    assert ours.tokens_per_expert.sum() == 0
