"""Online causal long convolution: feed y_t, get z_t[c] = sum_{j<=t} y_j[c] * rho_{t-j}[c].

Every engine serves G slots (e.g. layers x Hyena orders) that share one clock: at each position the slots are
stepped in order 0 .. G-1, because a slot's input may depend on the previous slot's output. A slot's input is a
(B, D) batch x channels. `prefill` consumes a whole prompt exactly (by FFT) and leaves the engine in the state it
would have reached by stepping through it. All state lives in (G, D, B, L) buffers, so each step is a handful of
tensor ops vectorized over batch and channels.

- lazy:      z_t as one dot product over the whole history: O(t) per step.
- eager:     y_t's contribution to every future output at once: O(L - t) per step.
- recompute: an FFT convolution of the whole prefix each step: O(t log t) per step.
- flash:     Flash Inference tiling (lcsm.inference.tiles): O(L log^2 L) in all, one tau call per tile for all slots.
"""

import abc

import torch
import torch.nn.functional as F

from lcsm.inference.tau import Tau, build_tau
from lcsm.inference.tiles import flash_tile
from lcsm.model.fftconv import fft_causal_conv, next_pow2


class OnlineConv(abc.ABC):
    name = ""

    def __init__(self, rho_GDL: torch.Tensor, batch: int):
        if rho_GDL.dim() != 3 or min(rho_GDL.shape) < 1:
            raise ValueError(f"rho must be (slots, channels, length) with every size >= 1, got {tuple(rho_GDL.shape)}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.rho_GDL = rho_GDL
        self.G, self.D, self.L = rho_GDL.shape
        self.B = batch
        self.pos = 0  # positions fully stepped by every slot

    def _buffer(self) -> torch.Tensor:
        return self.rho_GDL.new_zeros(self.G, self.D, self.B, self.L)

    def _check(self, y: torch.Tensor, shape: tuple[int, ...], slot: int) -> None:
        if y.dtype != self.rho_GDL.dtype or y.device != self.rho_GDL.device:
            raise ValueError(
                f"input is {y.dtype} on {y.device} but the filter is {self.rho_GDL.dtype} on "
                f"{self.rho_GDL.device}; convert one to match"
            )
        if tuple(y.shape) != shape:
            raise ValueError(f"input must have shape {shape}, got {tuple(y.shape)}")
        if not 0 <= slot < self.G:
            raise ValueError(f"slot must be in [0, {self.G}), got {slot}")

    def prefill(self, y_BDP: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """Consumes a prompt (B, D, P) for one slot and returns its outputs (B, D, P), exactly."""
        P = y_BDP.shape[-1]
        self._check(y_BDP, (self.B, self.D, P), slot)
        if self.pos != 0:
            raise ValueError("prefill must come before any step; build a new engine for a new sequence")
        if not 1 <= P <= self.L:
            raise ValueError(f"prompt length must be in [1, {self.L}] (the filter length), got {P}")
        z_BDP = fft_causal_conv(y_BDP, self.rho_GDL[slot])
        self._prefill_state(y_BDP.permute(1, 0, 2), slot)
        if slot == self.G - 1:
            self.pos = P
        return z_BDP

    def step(self, y_BD: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """Consumes y_t (B, D) for one slot and returns z_t (B, D)."""
        if y_BD.dtype != self.rho_GDL.dtype or y_BD.device != self.rho_GDL.device:
            self._check(y_BD, (self.B, self.D), slot)
        if self.pos >= self.L:
            raise ValueError(f"all {self.L} positions are used; build the engine with a longer filter")
        z_DB = self._step(y_BD.T, slot, self.pos)
        if slot == self.G - 1:
            self.pos += 1
        return z_DB.T

    @abc.abstractmethod
    def _prefill_state(self, y_DBP: torch.Tensor, slot: int) -> None: ...

    @abc.abstractmethod
    def _step(self, y_DB: torch.Tensor, slot: int, t: int) -> torch.Tensor: ...


class LazyConv(OnlineConv):
    name = "lazy"

    def __init__(self, rho_GDL, batch):
        super().__init__(rho_GDL, batch)
        self.y = list(self._buffer().unbind(0))
        self.rho_rev = list(rho_GDL.flip(-1).unsqueeze(2).contiguous().unbind(0))  # (D, 1, L) per slot

    def _prefill_state(self, y_DBP, slot):
        self.y[slot][..., : y_DBP.shape[-1]] = y_DBP

    def _step(self, y_DB, slot, t):
        y = self.y[slot]
        y[..., t] = y_DB
        return torch.linalg.vecdot(y[..., : t + 1], self.rho_rev[slot][..., self.L - 1 - t :])


class EagerConv(OnlineConv):
    name = "eager"

    def __init__(self, rho_GDL, batch):
        super().__init__(rho_GDL, batch)
        self.acc = list(self._buffer().unbind(0))
        self.rho = list(rho_GDL.unsqueeze(2).unbind(0))  # (D, 1, L) per slot

    def _prefill_state(self, y_DBP, slot):
        P = y_DBP.shape[-1]
        z_all = fft_causal_conv(F.pad(y_DBP, (0, self.L - P)), self.rho[slot])
        self.acc[slot][..., P:] = z_all[..., P:]

    def _step(self, y_DB, slot, t):
        acc = self.acc[slot]
        acc[..., t:].addcmul_(y_DB.unsqueeze(-1), self.rho[slot][..., : self.L - t])
        return acc[..., t].clone()


class RecomputeConv(OnlineConv):
    name = "recompute"

    def __init__(self, rho_GDL, batch):
        super().__init__(rho_GDL, batch)
        self.y = list(self._buffer().unbind(0))
        # A power-of-two FFT of size n >= t + 1 gives output t without wrap-around; one spectrum per size.
        sizes = [1 << k for k in range(next_pow2(self.L).bit_length())]
        self.spectra = {n: torch.fft.rfft(rho_GDL[..., :n], n=n).unsqueeze(2).unbind(0) for n in sizes}

    def _prefill_state(self, y_DBP, slot):
        self.y[slot][..., : y_DBP.shape[-1]] = y_DBP

    def _step(self, y_DB, slot, t):
        y = self.y[slot]
        y[..., t] = y_DB
        n = next_pow2(t + 1)
        return torch.fft.irfft(torch.fft.rfft(y[..., : t + 1], n=n) * self.spectra[n][slot], n=n)[..., t]


class FlashConv(OnlineConv):
    """Flash Inference. Tiles of size >= block go through tau; the pairs inside one b-aligned block are summed by the
    sequential part of each step, which merges the many tiny tiles into one small dot product per step.

    With batch_layers, the tile after each position runs once for all slots (they share the tile size); otherwise
    each slot launches its own.
    """

    name = "flash"

    def __init__(self, rho_GDL, batch, tau: str = "hybrid", block: int = 16, batch_layers: bool = True):
        super().__init__(rho_GDL, batch)
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 1, got {block}")
        self.block = block
        G, D, B, L = self.G, self.D, self.B, self.L
        # y has b spare zero columns so that the last block's window is whole.
        y, acc = rho_GDL.new_zeros(G, D, B, L + block), self._buffer()
        self.y, self.acc = list(y.unbind(0)), list(acc.unbind(0))
        # The sequential part dots the whole b-aligned block of inputs (those not written yet are zero) with the
        # reversed filter at offset o = t mod b; the b windows per slot are views made once.
        rho_rev = F.pad(rho_GDL.flip(-1), (0, block)).unsqueeze(-1)  # (G, D, L + b, 1)
        self.rho_windows = [[r[:, L - 1 - o : L - 1 - o + block] for o in range(min(block, L))] for r in rho_rev]
        self.y_window: list[torch.Tensor | None] = [None] * G
        if batch_layers:
            # (tau, input rows, output rows) launched after the last slot steps; rows are (slot, channel) pairs.
            rows = (build_tau(tau, rho_GDL.reshape(G * D, L)), y.view(G * D, B, L + block), acc.view(G * D, B, L))
            self.group_of_slot = [None] * (G - 1) + [rows]
        else:
            self.group_of_slot = [(build_tau(tau, rho_GDL[g]), self.y[g], self.acc[g]) for g in range(G)]
        self.sizes = [U for U in (1 << k for k in range(max(L - 1, 1).bit_length())) if block <= U < L]
        for group in self.group_of_slot:
            if group is not None:
                for U in self.sizes:
                    group[0].prepare(U)

    def _tile(self, group: tuple[Tau, torch.Tensor, torch.Tensor], t: int, U: int, first_out: int) -> None:
        """Adds inputs t-U+1 .. t to outputs max(t+1, first_out) .. min(t+U, L-1)."""
        tau, y_RBL, acc_RBL = group
        out_RBU = tau(y_RBL[..., t - U + 1 : t + 1])
        lo, hi = max(t + 1, first_out), min(t + U, self.L - 1)
        acc_RBL[..., lo : hi + 1] += out_RBU[..., lo - t - 1 : hi - t]

    def _prefill_state(self, y_DBP, slot):
        P = y_DBP.shape[-1]
        self.y[slot][..., :P] = y_DBP
        group = self.group_of_slot[slot]
        if group is None:
            return
        # Of the tiles launched before P, only the last one of each size can reach an output >= P.
        for U in self.sizes:
            odd_multiple = (P // U) - (1 - (P // U) % 2)
            t = odd_multiple * U - 1
            if odd_multiple > 0 and t + U >= P:
                self._tile(group, t, U, first_out=P)

    def _step(self, y_DB, slot, t):
        offset = t % self.block
        if offset == 0 or self.y_window[slot] is None:
            start = t - offset
            self.y_window[slot] = self.y[slot][..., start : start + self.block]
        window = self.y_window[slot]
        window.select(2, offset).copy_(y_DB)
        z_DB1 = torch.baddbmm(self.acc[slot][..., t : t + 1], window, self.rho_windows[slot][offset])
        group = self.group_of_slot[slot]
        U = flash_tile(t, self.block)
        if group is not None and U and t + 1 < self.L:
            self._tile(group, t, U, first_out=t + 1)
        return z_DB1.squeeze(-1)


ENGINES: dict[str, type[OnlineConv]] = {e.name: e for e in (LazyConv, EagerConv, RecomputeConv, FlashConv)}


def build_engine(name: str, rho_GDL: torch.Tensor, batch: int, **flash_options) -> OnlineConv:
    """An engine by name; flash_options (tau, block, batch_layers) go to flash and must be empty for the others."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    if flash_options and name != "flash":
        raise ValueError(f"options {sorted(flash_options)} apply to the flash engine only, not {name!r}")
    return ENGINES[name](rho_GDL, batch, **flash_options)
