"""The decoder toolkit's causal attention: a plain softmax attention in float64 is the reference; on a CPU, bf16
heads narrower than 64 run in fp32, other heads in SDPA as given."""

import math

import pytest
import torch
import torch.nn.functional as F

from titan.models.common.decoder import causal_attention


def _reference_BHTD(q, k, v, scale=None):
    """Causal softmax attention in float64, k and v heads repeated for grouped queries."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    T = q.shape[2]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(head_dim, dtype, heads=4, kv_heads=2, B=2, T=33):
    g = torch.Generator().manual_seed(head_dim)
    # Heads as the decoder makes them: (B, T, H, D) transposed, not contiguous.
    return [torch.randn(B, T, h, head_dim, generator=g).to(dtype).transpose(1, 2).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_small_bf16_heads_on_a_cpu_attend_in_fp32_even_under_autocast(head_dim):
    q, k, v = _qkv(head_dim, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention(q, k, v)
    fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp32.bfloat16())
    grad_out = torch.randn_like(out)
    assert all(torch.equal(a, b) for a, b in zip(_grads(out, (q, k, v), grad_out),
                                                 _grads(fp32.bfloat16(), (q, k, v), grad_out)))


@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (16, torch.float32), (16, torch.float64)])
def test_other_heads_take_sdpa_in_their_own_dtype(head_dim, dtype):
    q, k, v = _qkv(head_dim, dtype)
    out = causal_attention(q, k, v)
    assert out.dtype == dtype
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("head_dim, dtype, tol", [(16, torch.bfloat16, 1e-2), (64, torch.bfloat16, 1e-2),
                                                  (16, torch.float64, 1e-12)])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_outputs_and_gradients_match_float64_softmax_attention(head_dim, dtype, tol, kv_heads):
    q, k, v = _qkv(head_dim, dtype, kv_heads=kv_heads)
    out = causal_attention(q, k, v)
    expected = _reference_BHTD(q, k, v)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for got, want in zip(_grads(out, (q, k, v), grad_out), _grads(expected, (q, k, v), grad_out.double())):
        torch.testing.assert_close(got.double(), want.double(), atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_given_scale_replaces_one_over_sqrt_head_dim(head_dim):
    # DeepSeek-V3's attention scales by its unpadded query width and YaRN's mscale.
    q, k, v = _qkv(head_dim, torch.bfloat16)
    torch.testing.assert_close(causal_attention(q, k, v, scale=0.3).double(), _reference_BHTD(q, k, v, scale=0.3),
                               atol=1e-2, rtol=1e-2)
