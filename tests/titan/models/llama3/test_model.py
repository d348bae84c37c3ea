"""Llama 3.1: shapes, RoPE scaling, causality and the meta -> init path."""

import dataclasses
import math

import pytest
import torch

from titan.models.common.decoder import flops_per_token, num_params
from titan.models.common.rope import apply_rotary, rope_cache, rope_frequencies
from titan.models.llama3 import ModelArgs, Transformer, llama3_flavors


def test_flops_per_token_is_6n_plus_attention():
    args = llama3_flavors["8B"]
    with torch.device("meta"):
        model = Transformer(args)
    n = num_params(model, exclude_embedding=True)
    assert flops_per_token(model, args, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192


def test_gqa_heads_must_divide():
    with pytest.raises(ValueError, match="n_heads 6 is not divisible by n_kv_heads 4"):
        ModelArgs(dim=48, n_heads=6, n_kv_heads=4)


def test_rope_31_scaling_keeps_high_and_divides_low_frequencies():
    args = ModelArgs(dim=128, n_heads=1)
    plain = rope_frequencies(dataclasses.replace(args, rope_scaling="none"))
    scaled = rope_frequencies(args)
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)


def test_rotary_preserves_norms_and_relative_positions():
    args = ModelArgs(dim=32, n_heads=2)
    table = rope_cache(args, 16)
    q = torch.randn(1, 16, 2, 16)
    k = torch.randn(1, 16, 2, 16)
    torch.testing.assert_close(apply_rotary(q, table).norm(dim=-1), q.norm(dim=-1))
    # The score between positions depends only on their distance: shift both by 3.
    same_q = q[:, :1].expand(1, 16, 2, 16)
    same_k = k[:, :1].expand(1, 16, 2, 16)
    s = (apply_rotary(same_q, table)[:, 5] * apply_rotary(same_k, table)[:, 2]).sum(-1)
    s_shift = (apply_rotary(same_q, table)[:, 8] * apply_rotary(same_k, table)[:, 5]).sum(-1)
    torch.testing.assert_close(s, s_shift, atol=1e-5, rtol=1e-5)


def _tiny_model(seed=0):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_meta_build_then_init_is_deterministic_and_finite():
    a, b = _tiny_model(), _tiny_model()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all()
    tokens = torch.randint(0, 97, (2, 16))
    assert a(tokens).shape == (2, 16, 97)


def test_forward_is_causal():
    model = _tiny_model()
    tokens = torch.randint(0, 97, (1, 20))
    changed = tokens.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 97
    torch.testing.assert_close(model(tokens)[:, :12], model(changed)[:, :12])
    assert not torch.allclose(model(tokens)[:, 12:], model(changed)[:, 12:])


def test_initial_logits_are_order_one():
    # Output weights of std dim**-0.5 over unit-norm features give logits of std ~1: loss ~ log V + 1/2.
    model = _tiny_model()
    tokens = torch.randint(0, 97, (4, 32))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert 0 < loss.item() - math.log(97) < 1.0
