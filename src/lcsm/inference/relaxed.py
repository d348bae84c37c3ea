"""Flash Inference for data-dependent filters: both factors of z_t = sum_{j+k=t} y_j * rho_k arrive online.

The symmetric relaxed product (tiles.relaxed_squares) covers every (j, k) pair exactly once with squares that
use only values already known, in O(L log^2 L) per channel. Filters may differ per sequence: rho_t is (B, D).
"""

import torch

from lcsm.inference.tiles import relaxed_squares
from lcsm.model.fftconv import fft_causal_conv, next_pow2


def full_conv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The full linear convolution over the last dim (length len(a) + len(b) - 1), by FFT."""
    n_out = a.shape[-1] + b.shape[-1] - 1
    n = next_pow2(n_out)
    return torch.fft.irfft(torch.fft.rfft(a, n=n) * torch.fft.rfft(b, n=n), n=n)[..., :n_out]


class RelaxedConv:
    """Online z_t for inputs y_t and filter values rho_t that both arrive at step t, for B x D channels."""

    def __init__(self, channels: int, batch: int, length: int, dtype=torch.float32, device=None):
        if min(channels, batch, length) < 1:
            raise ValueError(f"channels, batch and length must be >= 1, got {channels}, {batch}, {length}")
        self.L = length
        shape = (channels, batch, length)
        self.y, self.rho, self.acc = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(3))
        self.pos = 0

    def _check(self, y: torch.Tensor, rho: torch.Tensor, n: int) -> None:
        for x in (y, rho):
            if x.dtype != self.y.dtype or x.device != self.y.device:
                raise ValueError(f"inputs must be {self.y.dtype} on {self.y.device}, got {x.dtype} on {x.device}")
        if self.pos + n > self.L:
            raise ValueError(f"{self.pos + n} positions exceed the length {self.L}; build the engine longer")

    def _add(self, first_out: int, out_DBn: torch.Tensor, lowest_out: int) -> None:
        """Adds outputs first_out .. to acc, dropping those before lowest_out or beyond L."""
        lo, hi = max(first_out, lowest_out), min(first_out + out_DBn.shape[-1], self.L)
        if lo < hi:
            self.acc[..., lo:hi] += out_DBn[..., lo - first_out : hi - first_out]

    def prefill(self, y_BDP: torch.Tensor, rho_BDP: torch.Tensor) -> torch.Tensor:
        """Consumes a prompt and its filter values (B, D, P); returns z (B, D, P), exactly."""
        P = y_BDP.shape[-1]
        self._check(y_BDP, rho_BDP, P)
        if self.pos != 0 or P < 1:
            raise ValueError("prefill needs a non-empty prompt and must come before any step")
        y, rho = self.y, self.rho
        y[..., :P], rho[..., :P] = y_BDP.permute(1, 0, 2), rho_BDP.permute(1, 0, 2)
        # The squares done before step P, per size U, merge into two rectangles (see lcsm.inference.tiles):
        # inputs [U, 2U) x lags [U, MU) and inputs [2U, MU) x lags [U, 2U), with M = P // U.
        U = 1
        while 2 * U <= P:
            M = P // U
            self._add(2 * U, full_conv(y[..., U : 2 * U], rho[..., U : M * U]), P)
            if M >= 3:
                self._add(3 * U, full_conv(y[..., 2 * U : M * U], rho[..., U : 2 * U]), P)
            U *= 2
        self.pos = P
        return fft_causal_conv(y_BDP, rho_BDP)

    def step(self, y_BD: torch.Tensor, rho_BD: torch.Tensor) -> torch.Tensor:
        """Consumes y_t and rho_t (B, D); returns z_t (B, D)."""
        self._check(y_BD, rho_BD, 1)
        t = self.pos
        y, rho = self.y, self.rho
        y[..., t], rho[..., t] = y_BD.T, rho_BD.T
        z = self.acc[..., t] + y[..., t] * rho[..., 0]
        if t > 0:
            z += y[..., 0] * rho[..., t]
        for j, k, U in relaxed_squares(t):
            self._add(j + k, full_conv(y[..., j : j + U], rho[..., k : k + U]), t + 1)
        self.pos += 1
        return z.T
