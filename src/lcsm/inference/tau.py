"""tau: the Toeplitz tile of Flash Inference, behind a registry of interchangeable implementations.

For a block of U inputs y (R rows, B batch, U steps) and one filter per row, tau returns the block's contribution to
the next U outputs: out[r, b, m] = sum_k y[r, b, k] * rho[r, U + m - k], which uses filter lags 1 .. 2U-1 only.
The filter is fixed, so every implementation precomputes its filter side once per tile size in `prepare`.
"""

from __future__ import annotations

import abc
import copy
import functools
import os

import torch
import torch.nn.functional as F

from lcsm.inference import accel
from lcsm.inference.accel import autotune
from lcsm.model.fftconv import next_pow2


def filter_lags(rho_RL: torch.Tensor, n: int) -> torch.Tensor:
    """The first n lags of each row's filter, zero beyond its length."""
    L = rho_RL.shape[-1]
    return rho_RL[:, :n] if L >= n else F.pad(rho_RL, (0, n - L))


class Tau(abc.ABC):
    """Base: rows' filters rho (R, L); subclasses fill `self.prepared[U]` and compute one tile in `__call__`."""

    name = ""

    def __init__(self, rho_RL: torch.Tensor):
        self.rho_RL = rho_RL
        self.prepared: dict[int, torch.Tensor] = {}

    @abc.abstractmethod
    def prepare(self, U: int) -> None: ...

    def rows(self, lo: int, hi: int) -> Tau:
        """The same tau for rows lo .. hi-1 alone, sharing this one's prepared filters (prepare first)."""
        part = copy.copy(self)
        part.rho_RL = self.rho_RL[lo:hi]
        part.prepared = {U: p[lo:hi] for U, p in self.prepared.items()}
        return part

    @abc.abstractmethod
    def __call__(self, y_RBU: torch.Tensor) -> torch.Tensor: ...


class DirectTau(Tau):
    """Batched matmul with each row's U x U Toeplitz matrix T[k, m] = rho[U + m - k]: O(U^2), fastest for small U."""

    name = "direct"
    max_bytes = 2**30

    def prepare(self, U):
        R = self.rho_RL.shape[0]
        if R * U * U * self.rho_RL.element_size() > self.max_bytes:
            raise MemoryError(f"tau 'direct' would need {R * U * U * self.rho_RL.element_size() / 2**30:.1f} GiB "
                              f"of Toeplitz matrices for tiles of {U}; use tau='fft' or 'hybrid'")
        hankel = filter_lags(self.rho_RL, 2 * U)[:, 1:].unfold(-1, U, 1)  # [r, i, j] = rho[r, 1 + i + j]
        self.prepared[U] = hankel.flip(1).contiguous()

    def __call__(self, y_RBU):
        return torch.bmm(y_RBU, self.prepared[y_RBU.shape[-1]])


class FFTTau(Tau):
    """Circular convolution of size 2U with the precomputed spectrum of lags 0 .. 2U-1: O(U log U).

    Outputs U .. 2U-1 of the circular product never wrap, because they pair input k < U with lags 1 .. 2U-1.
    """

    name = "fft"

    def prepare(self, U):
        self.prepared[U] = torch.fft.rfft(filter_lags(self.rho_RL, 2 * U), n=2 * U).unsqueeze(1)

    def __call__(self, y_RBU):
        U = y_RBU.shape[-1]
        return torch.fft.irfft(torch.fft.rfft(y_RBU, n=2 * U) * self.prepared[U], n=2 * U)[..., U:]


class Conv1dTau(Tau):
    """Depthwise conv1d (one group per row) with the reversed lags 1 .. 2U-1 as kernel."""

    name = "conv1d"

    def prepare(self, U):
        self.prepared[U] = filter_lags(self.rho_RL, 2 * U)[:, 1:].flip(-1).unsqueeze(1).contiguous()

    def __call__(self, y_RBU):
        U = y_RBU.shape[-1]
        out_BRU = F.conv1d(y_RBU.transpose(0, 1), self.prepared[U], padding=U - 1, groups=y_RBU.shape[0])
        return out_BRU.transpose(0, 1)


class TritonTau(Tau):
    """A Triton kernel reading the filter lags directly (CUDA, or the CPU interpreter with TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, rho_RL):
        super().__init__(rho_RL)
        if not triton_available(rho_RL.device):
            raise ValueError(
                "tau 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 to run it on the CPU for "
                "testing); use tau='fft' or tau='hybrid'"
            )
        self.rho_pad = filter_lags(rho_RL, 2 * next_pow2(rho_RL.shape[-1])).contiguous()

    def rows(self, lo, hi):
        part = super().rows(lo, hi)
        part.rho_pad = self.rho_pad[lo:hi]
        return part

    def prepare(self, U):
        self.prepared[U] = self.rho_pad  # the kernel reads the lags in place

    def __call__(self, y_RBU):
        from lcsm.inference.accel.tau_triton import toeplitz_tile

        return toeplitz_tile(y_RBU.contiguous(), self.rho_pad)


def triton_available(device: torch.device) -> bool:
    """Triton and a CUDA device (or its CPU interpreter, TRITON_INTERPRET=1), the accelerations on."""
    if not accel.enabled():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return device.type == "cpu"
    return device.type == "cuda"


class HybridTau(Tau):
    """Per tile size, the fastest of the other taus on this machine: timed once per machine and tile shape, and
    cached on disk (lcsm.inference.accel.autotune)."""

    name = "hybrid"
    quadratic_max_U = 1024  # the O(U^2) taus lose to the FFT well before this (and direct's matrices cost R U^2)

    def __init__(self, rho_RL):
        super().__init__(rho_RL)
        names = ["fft", "conv1d", "direct"] + (["triton"] if rho_RL.is_cuda and triton_available(rho_RL.device) else [])
        self.candidates = {name: TAUS[name](rho_RL) for name in names}
        self.chosen: dict[int, Tau] = {}

    def prepare(self, U):
        for name, tau in self.candidates.items():
            if name == "fft" or U <= self.quadratic_max_U:
                try:
                    tau.prepare(U)
                except MemoryError:
                    continue  # direct's matrices for many rows: not a contender at this size
        self.prepared[U] = self.candidates["fft"].prepared[U]

    def rows(self, lo, hi):
        part = super().rows(lo, hi)
        part.candidates = {name: tau.rows(lo, hi) for name, tau in self.candidates.items()}
        part.chosen = {}
        return part

    def __call__(self, y_RBU):
        U = y_RBU.shape[-1]
        tau = self.chosen.get(U)
        if tau is None:
            able = {name: tau for name, tau in self.candidates.items() if U in tau.prepared}
            key = f"tau {y_RBU.device.type} {str(y_RBU.dtype)[6:]} rows={y_RBU.shape[0]} B={y_RBU.shape[1]} U={U}"
            name = autotune.choose(y_RBU.device, key, {n: functools.partial(t, y_RBU) for n, t in able.items()})
            tau = self.chosen[U] = able.get(name, self.candidates["fft"])  # a cached name may be unable here
        return tau(y_RBU)

    def choices(self) -> dict[int, str]:
        """The tau chosen per tile size so far."""
        return {U: tau.name for U, tau in sorted(self.chosen.items())}


TAUS: dict[str, type[Tau]] = {t.name: t for t in (DirectTau, FFTTau, Conv1dTau, TritonTau, HybridTau)}


def build_tau(name: str, rho_RL: torch.Tensor) -> Tau:
    if name not in TAUS:
        raise ValueError(f"unknown tau {name!r}; choose one of {', '.join(TAUS)}")
    return TAUS[name](rho_RL)
