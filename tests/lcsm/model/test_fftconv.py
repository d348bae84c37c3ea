import torch

from lcsm.model.fftconv import fft_causal_conv, next_pow2


def test_fft_causal_conv_equals_direct_sum_float64():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(2, 3, 37, generator=gen, dtype=torch.float64)
    rho = torch.randn(3, 50, generator=gen, dtype=torch.float64)  # longer than y: only the first 37 lags count
    z = torch.zeros_like(y)
    for t in range(37):
        for j in range(t + 1):
            z[..., t] += y[..., j] * rho[:, t - j]
    torch.testing.assert_close(fft_causal_conv(y, rho), z, rtol=0, atol=1e-10)


def test_fft_causal_conv_runs_half_precision_in_float32():
    y, rho = torch.randn(1, 2, 16, dtype=torch.bfloat16), torch.randn(2, 16)
    out = fft_causal_conv(y, rho)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), fft_causal_conv(y.float(), rho), rtol=1e-2, atol=1e-2)


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1000)] == [1, 2, 4, 4, 8, 1024]
