"""Causal long convolution by FFT: the training path and the reference every online engine is checked against."""

import torch


def fft_causal_conv(y: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """z[..., t] = sum_{j<=t} y[..., j] * rho[..., t - j] over the last dim of y (length L).

    rho is broadcast against y and may be longer than L (only its first L lags are used). An FFT of size 2L keeps
    the circular wrap-around out of the first L outputs. Half precision is promoted to float32 for the FFT.
    """
    L = y.shape[-1]
    compute_dtype = torch.promote_types(torch.promote_types(y.dtype, rho.dtype), torch.float32)
    n = 2 * L
    y_f = torch.fft.rfft(y.to(compute_dtype), n=n)
    rho_f = torch.fft.rfft(rho[..., :L].to(compute_dtype), n=n)
    return torch.fft.irfft(y_f * rho_f, n=n)[..., :L].to(y.dtype)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
