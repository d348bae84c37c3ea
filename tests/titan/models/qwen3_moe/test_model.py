"""Qwen3-MoE against transformers: random small Qwen3MoeConfigs import through titan.hf.load and export through
titan.hf.save with the same float64 logits (1e-6 relative), and the flavors have transformers' parameter counts."""

import dataclasses

import pytest
import torch

import titan.hf
from titan.components.loss import cross_entropy_loss
from titan.models.common.moe import MoE
from titan.models.common.moe_balance import load_balancing_loss
from titan.models.qwen3_moe.flavors import qwen3_moe_flavors
from titan.models.qwen3_moe.hf_config import to_hf
from titan.models.qwen3_moe.model import Qwen3MoeDecoder, active_params

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
            max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _hf_model(**overrides):
    # The per-expert loop: transformers' grouped GEMM has no float64.
    cfg = transformers.Qwen3MoeConfig(**{**TINY, **overrides}, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.float64).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms start at one there: randomize every tensor
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.3 + (1.0 if "norm" in name else 0))
    return model


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


def _tokens(seed):
    return torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True, "tie_word_embeddings": True},
                                       {"decoder_sparse_step": 2, "mlp_only_layers": [2]}],
                         ids=["every-layer", "norm-topk-tied", "sparse-step-mlp-only"])
def test_hf_folder_loads_with_transformers_logits_and_exports_back(tmp_path, overrides):
    theirs = _hf_model(**overrides)
    theirs.save_pretrained(tmp_path / "hf")
    ours = titan.hf.load(tmp_path / "hf")
    assert isinstance(ours, Qwen3MoeDecoder)
    with torch.no_grad():
        assert _rel(ours(_tokens(1)), theirs(_tokens(1)).logits) < 1e-6
    titan.hf.save(ours, tmp_path / "out", dtype=torch.float64)
    back, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                                   dtype=torch.float64,
                                                                   experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert _rel(ours(_tokens(2)), back.eval()(_tokens(2)).logits) < 1e-6


# Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json
HF_FLAVORS = {
    "30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936),
    "235B-A22B": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                      num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936),
}


@pytest.mark.parametrize("flavor", HF_FLAVORS)
def test_flavor_parameter_counts_equal_transformers(flavor):
    with torch.device("meta"):
        ours = Qwen3MoeDecoder(qwen3_moe_flavors[flavor])
        theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_FLAVORS[flavor]))
    total = sum(p.numel() for p in theirs.parameters())
    one_expert = sum(p[0].numel() for name, p in theirs.named_parameters() if ".mlp.experts." in name)
    assert sum(p.numel() for p in ours.parameters()) == total
    assert active_params(ours) == total - one_expert * (128 - 8)


def _hf_grads_per_expert(model) -> dict[str, torch.Tensor]:
    """transformers' gradients with each fused experts tensor split per expert, as its checkpoints name them."""
    grads = {}
    for name, p in model.named_parameters():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for j, (gate, up) in enumerate(zip(*p.grad.chunk(2, dim=1))):
                grads |= {f"{prefix}.{j}.gate_proj.weight": gate, f"{prefix}.{j}.up_proj.weight": up}
        elif kind == "down_proj":
            grads |= {f"{prefix}.{j}.down_proj.weight": g for j, g in enumerate(p.grad)}
        else:
            grads[name] = p.grad
    return grads


def test_training_gradients_equal_transformers_loss_plus_balance_loss(tmp_path):
    """In training our model adds router_aux_loss_coef x transformers' balance loss (over all layers' routing at
    once) to the gradient: the parameter gradients of loss + coef * aux equal Qwen3MoeForCausalLM's."""
    theirs = _hf_model(router_aux_loss_coef=0.3, norm_topk_prob=True)
    theirs.save_pretrained(tmp_path)
    ours = titan.hf.load(tmp_path).train()
    theirs.train()
    tokens = _tokens(3)
    out = theirs(tokens, labels=tokens, output_router_logits=True)
    records = []
    for moe in (m for m in ours.modules() if isinstance(m, MoE)):
        moe.register_forward_hook(lambda m, args, y: records.append(m.balance_stats))
    logits = ours(tokens)
    prob_sums, counts = (torch.stack([r[i] for r in records]) for i in (0, 1))
    torch.testing.assert_close(load_balancing_loss(prob_sums, counts, tokens.numel()).float(), out.aux_loss,
                               rtol=1e-6, atol=0)
    cross_entropy_loss(logits[:, :-1], tokens[:, 1:]).backward()
    out.loss.backward()
    ours_grads = to_hf({name: p.grad for name, p in ours.named_parameters()}, ours.args)
    theirs_grads = _hf_grads_per_expert(theirs)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, want in theirs_grads.items():
        assert _rel(ours_grads[name], want) < 1e-6, name


def test_per_layer_balance_loss_is_the_sum_of_transformers_loss_of_each_layer_alone(tmp_path):
    """balance_loss = "per_layer": the model adds coef x the sum over its MoE layers of transformers'
    load_balancing_loss_func on that layer's router logits alone (Switch's per-layer loss); each layer's term, the
    sum and every parameter gradient of loss + coef * sum equal theirs."""
    coef = 0.3
    theirs = _hf_model(router_aux_loss_coef=coef, norm_topk_prob=True)
    theirs.save_pretrained(tmp_path)
    loaded = titan.hf.load(tmp_path)
    ours = Qwen3MoeDecoder(dataclasses.replace(loaded.args, balance_loss="per_layer")).to(torch.float64)
    ours.load_state_dict(loaded.state_dict())
    ours.train()
    theirs.train()
    tokens = _tokens(3)
    out = theirs(tokens, output_router_logits=True)
    num_experts, top_k = TINY["num_experts"], TINY["num_experts_per_tok"]
    want_terms = [load_balancing_loss_func((r,), num_experts, top_k) for r in out.router_logits]
    records = []
    for moe in (m for m in ours.modules() if isinstance(m, MoE)):
        moe.register_forward_hook(lambda m, args, y: records.append(m.balance_stats))
    logits = ours(tokens)
    assert len(records) == len(want_terms) == 3
    for (prob_sums, counts, n), want in zip(records, want_terms):
        got = load_balancing_loss(prob_sums[None], counts[None], n, per_layer=True)
        torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    cross_entropy_loss(logits[:, :-1], tokens[:, 1:]).backward()
    (cross_entropy_loss(out.logits[:, :-1], tokens[:, 1:]) + coef * sum(want_terms)).backward()
    ours_grads = to_hf({name: p.grad for name, p in ours.named_parameters()}, ours.args)
    theirs_grads = _hf_grads_per_expert(theirs)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, want in theirs_grads.items():
        assert _rel(ours_grads[name], want) < 1e-6, name
