import pytest
import torch

from lcsm.inference.relaxed import RelaxedConv
from lcsm.model.fftconv import fft_causal_conv


@pytest.mark.parametrize("L,P", [(1, 0), (2, 0), (13, 0), (32, 0), (45, 1), (45, 2), (45, 17), (64, 32), (33, 33)])
def test_relaxed_product_is_exact(L, P):
    gen = torch.Generator().manual_seed(L * 100 + P)
    B, D = 2, 3
    y = torch.randn(B, D, L, generator=gen, dtype=torch.float64)
    rho = torch.randn(B, D, L, generator=gen, dtype=torch.float64)
    engine = RelaxedConv(D, B, L, dtype=torch.float64)
    z = torch.empty_like(y)
    if P:
        z[..., :P] = engine.prefill(y[..., :P], rho[..., :P])
    for t in range(P, L):
        z[..., t] = engine.step(y[..., t], rho[..., t])
    torch.testing.assert_close(z, fft_causal_conv(y, rho), rtol=0, atol=1e-10)


def test_relaxed_filter_from_input_feedback():
    """The filter value at t is computed from the input at t (a data-dependent filter)."""
    gen = torch.Generator().manual_seed(0)
    L, B, D = 40, 1, 2
    x = torch.randn(B, D, L, generator=gen, dtype=torch.float64)
    engine = RelaxedConv(D, B, L, dtype=torch.float64)
    y, rho, z = (torch.zeros(B, D, L, dtype=torch.float64) for _ in range(3))
    for t in range(L):
        y[..., t] = x[..., t] + (torch.tanh(z[..., t - 1]) if t else 0)
        rho[..., t] = torch.sigmoid(y[..., t]) * 0.9**t
        z[..., t] = engine.step(y[..., t], rho[..., t])
    torch.testing.assert_close(z, fft_causal_conv(y, rho), rtol=0, atol=1e-10)


def test_relaxed_bad_input():
    engine = RelaxedConv(2, 1, 4)
    with pytest.raises(ValueError, match="inputs must be torch.float32"):
        engine.step(torch.randn(1, 2, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="build the engine longer"):
        engine.prefill(torch.randn(1, 2, 5), torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match=">= 1"):
        RelaxedConv(0, 1, 4)
