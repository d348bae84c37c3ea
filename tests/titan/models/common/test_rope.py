"""The rotation: one complex multiply per pair, bit for bit the real arithmetic written out (forward and backward)."""

import pytest
import torch

from titan.models.common.rope import apply_rotary, rope_cache
from titan.models.llama3 import ModelArgs


def _by_hand(x_BTHD, rope_TH2, interleaved):
    """Pair (a, b) at angle θ -> (a cos θ - b sin θ, a sin θ + b cos θ), in at least fp32."""
    B, T, H, D = x_BTHD.shape
    x = x_BTHD.to(torch.promote_types(x_BTHD.dtype, torch.float32))
    x = x.reshape(B, T, H, D // 2, 2) if interleaved else x.reshape(B, T, H, 2, D // 2).transpose(-1, -2)
    cos, sin = rope_TH2[:T, None, :, 0].to(x.dtype), rope_TH2[:T, None, :, 1].to(x.dtype)
    real, imag = x[..., 0] * cos - x[..., 1] * sin, x[..., 0] * sin + x[..., 1] * cos
    out = torch.stack((real, imag), dim=-1) if interleaved else torch.stack((real, imag), dim=-2)
    return out.flatten(3).type_as(x_BTHD)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotation_and_its_gradient_are_the_pairwise_formula_bit_for_bit(dtype, interleaved):
    table = rope_cache(ModelArgs(dim=128, n_heads=8), 24)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20, 3, 16, generator=gen, dtype=dtype)
    grad = torch.randn(2, 20, 3, 16, generator=gen, dtype=dtype)
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = apply_rotary(got, table, interleaved), _by_hand(want, table, interleaved)
    out.backward(grad)
    ref.backward(grad)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(got.grad, want.grad)


def test_a_strided_slice_of_the_heads_rotates_like_a_copy():
    """MLA rotates the last part of each query head, a view at an offset into the row."""
    table = rope_cache(ModelArgs(dim=64, n_heads=4), 8)
    q = torch.randn(1, 8, 2, 21)
    assert torch.equal(apply_rotary(q[..., 5:], table), apply_rotary(q[..., 5:].clone(), table))


@pytest.mark.parametrize("interleaved", [True, False])
def test_the_real_arithmetic_that_compiled_code_fuses_is_the_same_rotation(monkeypatch, interleaved):
    table = rope_cache(ModelArgs(dim=64, n_heads=4), 8)
    x = torch.randn(2, 8, 2, 16, dtype=torch.float64)
    eager = apply_rotary(x, table, interleaved)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(apply_rotary(x, table, interleaved), eager)
