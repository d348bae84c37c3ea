"""tau: the Toeplitz tile of Flash Inference, behind a registry of interchangeable implementations.

For a block of U inputs y (R rows, B batch, U steps) and one filter per row, tau returns the block's contribution to
the next U outputs: out[r, b, m] = sum_k y[r, b, k] * rho[r, U + m - k], which uses filter lags 1 .. 2U-1 only.
The filter is fixed, so every implementation precomputes its filter side once per tile size in `prepare`.
"""

import abc
import os
import time

import torch
import torch.nn.functional as F

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

    def prepare(self, U):
        self.prepared[U] = self.rho_pad  # the kernel reads the lags in place

    def __call__(self, y_RBU):
        from lcsm.inference.tau_triton import toeplitz_tile

        return toeplitz_tile(y_RBU.contiguous(), self.rho_pad)


def triton_available(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return device.type == "cpu"
    return device.type == "cuda"


_AUTOTUNED: dict[tuple, str] = {}
"""hybrid's choices, shared by every engine in the process: (device, dtype, rows, batch, U) -> tau name."""


class HybridTau(Tau):
    """Per tile size, the fastest of the other taus on this machine, from a short timing the first time it is used."""

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

    def __call__(self, y_RBU):
        U = y_RBU.shape[-1]
        tau = self.chosen.get(U)
        if tau is None:
            key = (str(y_RBU.device), y_RBU.dtype, *y_RBU.shape)
            if key not in _AUTOTUNED:
                _AUTOTUNED[key] = self._fastest(y_RBU)
            tau = self.chosen[U] = self.candidates[_AUTOTUNED[key]]
        return tau(y_RBU)

    def _fastest(self, y_RBU: torch.Tensor) -> str:
        U = y_RBU.shape[-1]
        # CPU time on the CPU, so that other jobs on a shared machine do not skew the choice.
        clock = time.perf_counter if y_RBU.is_cuda else time.process_time
        timings = {}
        for name, tau in self.candidates.items():
            if U not in tau.prepared:
                continue
            tau(y_RBU)  # warm-up (and Triton compilation)
            reps = max(1, min(20, 2**16 // (U * max(1, y_RBU.shape[0] // 64))))
            if y_RBU.is_cuda:
                torch.cuda.synchronize()
            start = clock()
            for _ in range(reps):
                tau(y_RBU)
            if y_RBU.is_cuda:
                torch.cuda.synchronize()
            timings[name] = (clock() - start) / reps
        return min(timings, key=timings.get)


TAUS: dict[str, type[Tau]] = {t.name: t for t in (DirectTau, FFTTau, Conv1dTau, TritonTau, HybridTau)}


def build_tau(name: str, rho_RL: torch.Tensor) -> Tau:
    if name not in TAUS:
        raise ValueError(f"unknown tau {name!r}; choose one of {', '.join(TAUS)}")
    return TAUS[name](rho_RL)
