"""DeepSeek-V3 against transformers: random small DeepseekV3Configs import through titan.hf.load and export
through titan.hf.save with the same float64 logits (1e-6 relative), the flavors have transformers' parameter
counts, and the sequence-wise balance loss (no transformers counterpart) and its gradients are the report's
equations (a float64 hand reference)."""

import pytest
import torch

import titan.hf
from titan.models.deepseek_v3.flavors import deepseek_v3_flavors
from titan.models.deepseek_v3.model import Transformer, active_params

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=3,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, max_position_embeddings=640,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 16})


@pytest.fixture(autouse=True)
def float64_hf_norms(monkeypatch):
    """transformers' DeepSeek-V3 RMSNorm rounds to float32 even in a float64 model (1e-6 off after 3 layers):
    let it keep float64, so that the comparison measures the architecture, not that rounding."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(hf.DeepseekV3RMSNorm, "forward", forward)


def _hf_model(**overrides):
    # The per-expert loop: transformers' grouped GEMM has no float64.
    cfg = transformers.DeepseekV3Config(**{**TINY, **overrides}, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms start at one and biases at zero there: randomize every tensor
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" not in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * (0.1 if "bias" in name else 0.3)
                        + (1.0 if "norm" in name else 0.0))
    return model


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 20}, {"rope_interleave": False},
                                       {"n_group": 1, "topk_group": 1, "rope_parameters": None}],
                         ids=["yarn-groups", "q-lora", "half-split-rope", "plain"])
def test_hf_folder_imports_with_transformers_logits(tmp_path, overrides):
    theirs = _hf_model(**overrides)
    theirs.save_pretrained(tmp_path)
    ours = titan.hf.load(tmp_path)
    assert isinstance(ours, Transformer)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(ours(tokens), theirs(tokens).logits) < 1e-6


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    _hf_model().save_pretrained(tmp_path / "src")
    ours = titan.hf.load(tmp_path / "src")
    titan.hf.save(ours, tmp_path / "out", dtype=torch.float64)
    theirs, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                                      dtype=torch.float64,
                                                                      experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(ours(tokens), theirs.eval()(tokens).logits) < 1e-6


# transformers' DeepseekV3Config for each flavor (DeepseekV3ForCausalLM builds no multi-token-prediction layer).
HF_FLAVORS = {
    "16B": dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
                n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
                q_lora_rank=None),
    "671B": {},
}


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_flavor_parameter_counts_equal_transformers(flavor):
    with torch.device("meta"):
        ours = Transformer(deepseek_v3_flavors[flavor])
        theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_FLAVORS[flavor]))
    total = sum(p.numel() for p in theirs.parameters())
    # One expert of every MoE layer: [E, ...] tensors there too.
    one_expert = sum(p[0].numel() for name, p in theirs.named_parameters() if ".mlp.experts." in name)
    unused = one_expert * (theirs.config.n_routed_experts - theirs.config.num_experts_per_tok)
    assert sum(p.numel() for p in ours.parameters()) == total
    assert active_params(ours) == total - unused


def _report_sequence_loss(routing, sequences, top_k):
    """Section 2.1.2 of the DeepSeek-V3 report, eqs. 17-20, sequence by sequence: f_i = N_r / (K_r T) x the tokens
    whose top K_r hold expert i, P_i = 1/T sum_t s'_it with s'_it = s_it / sum_j s_jt over all N_r experts; each
    layer's sum_i f_i P_i averaged over the sequences, summed over the layers."""
    total = 0.0
    for scores_TE, experts_TK in routing:
        num_experts = scores_TE.shape[-1]
        for s_TE, chosen_TK in zip(scores_TE.chunk(sequences), experts_TK.chunk(sequences)):
            tokens = len(s_TE)
            hits = torch.stack([(chosen_TK == i).any(dim=1).sum() for i in range(num_experts)]).to(s_TE.dtype)
            f = hits * num_experts / (top_k * tokens)
            p = (s_TE / s_TE.sum(dim=1, keepdim=True)).mean(dim=0)
            total = total + (f * p).sum() / sequences
    return total


def test_sequence_wise_balance_loss_and_gradients_equal_the_reports_equations():
    """In training with seq_aux_loss_alpha the model adds alpha x the report's sequence-wise loss of each MoE layer
    (its top-k picked with the selection bias, its scores without) to the gradient: the loss and every parameter
    gradient of cross-entropy + alpha x the loss equal a float64 hand reference over 3 sequences."""
    from titan.components.loss import cross_entropy_loss
    from titan.models.common.moe import MoE
    from titan.models.common.moe_balance import sequence_balance_loss
    from titan.models.deepseek_v3.model import ModelArgs

    alpha, top_k = 0.5, 3
    args = ModelArgs(dim=32, n_layers=3, n_dense_layers=1, n_heads=2, vocab_size=61, inter_dim=48, moe_inter_dim=16,
                     n_routed_experts=8, n_shared_experts=1, n_activated_experts=top_k, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_factor=1.0, max_seq_len=16,
                     seq_aux_loss_alpha=alpha)
    torch.manual_seed(0)
    model = Transformer(args).to(torch.float64)
    model.init_weights()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():  # scores far from 1/2 and a bias that changes the choice: the loss has something to see
        for moe in layers:
            moe.router.gate.weight.normal_(0, 0.5)
            moe.router.expert_bias.normal_(0, 0.1)
    tokens = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(4))
    model.train()
    records, routing = [], []
    for moe in layers:
        moe.register_forward_hook(lambda m, inputs, y: records.append(m.balance_stats))
        moe.router.register_forward_hook(lambda m, inputs, y: routing.append((y[2], y[1])))
    cross_entropy_loss(model(tokens)[:, :-1], tokens[:, 1:]).backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    want = _report_sequence_loss(routing, len(tokens), top_k)
    prob_sums, counts = (torch.stack([r[i] for r in records]) for i in (0, 1))
    torch.testing.assert_close(sequence_balance_loss(prob_sums, counts, records[0][2], top_k), want,
                               rtol=1e-12, atol=0)
    model.zero_grad()
    for moe in layers:  # the reference adds the loss itself
        moe.args.aux_loss_coef = 0.0
    routing.clear()
    logits = model(tokens)
    (cross_entropy_loss(logits[:, :-1], tokens[:, 1:]) + alpha * _report_sequence_loss(routing, 3, top_k)).backward()
    for name, p in model.named_parameters():
        assert _rel(ours[name], p.grad) < 1e-10, name


def test_a_negative_or_infinite_sequence_loss_weight_is_one_user_error():
    from titan.models.deepseek_v3.model import ModelArgs
    from titan.tools.cli import UserError

    for alpha in (-1e-4, float("inf"), float("nan")):
        with pytest.raises(UserError, match=r"^seq_aux_loss_alpha must be a finite number >= 0"):
            ModelArgs(seq_aux_loss_alpha=alpha)
