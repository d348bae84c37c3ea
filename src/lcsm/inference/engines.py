"""Online causal long convolution: feed y_t, get z_t[c] = sum_{j<=t} y_j[c] * rho_{t-j}[c].

Every engine serves G slots (e.g. layers x Hyena orders) that share one clock: at each position the slots are
stepped in order 0 .. G-1, because a slot's input may depend on the previous slot's output. A slot's input is a
(B, D) batch x channels. `prefill` consumes a whole prompt exactly (by FFT) and leaves the engine in the state it
would have reached by stepping through it. All state lives in (G, D, B, L) buffers, so each step is a handful of
tensor ops vectorized over batch and channels, or for lazy and flash on a CPU one C call (lcsm.inference.accel,
off with LCSM_ACCEL=0).

- lazy:      z_t as one dot product over the whole history: O(t) per step.
- eager:     y_t's contribution to every future output at once: O(L - t) per step.
- recompute: an FFT convolution of the whole prefix each step: O(t log t) per step.
- flash:     Flash Inference tiling (lcsm.inference.tiles): O(L log^2 L) in all, one tau call per tile for all slots.
"""

import abc
import ctypes

import torch
import torch.nn.functional as F

from lcsm.inference.accel import autotune, native
from lcsm.inference.tau import Tau, build_tau
from lcsm.inference.tiles import lowbit
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
        self.step_shape, self.dtype, self.device = torch.Size((batch, self.D)), rho_GDL.dtype, rho_GDL.device
        self._outputs: list[torch.Tensor] = []  # C steps' outputs to come (_c_io)

    def _c_function(self, make, wanted: bool | None):
        """The engine's step in C (make(device, dtype), lcsm.inference.accel.native) or None. wanted: None where it
        can be built (float32 or float64 on a CPU with a C compiler), True to require it, False for tensor ops."""
        step = make(self.device, self.dtype) if wanted is not False else None
        if step is None and wanted:
            raise ValueError("native_step=True needs float32 or float64 on a CPU and a C compiler (cc, gcc or "
                             "clang, or $CC); use native_step=None to fall back to tensor ops")
        return step

    def _c_io(self, y_BD: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A C step's input, contiguous (the caller keeps it alive through the call), and its (B, D) output: `out`,
        or a fresh one cut from a chunk made once per 1024 steps (a view costs less than torch.empty)."""
        if out is None:
            if not self._outputs:
                self._outputs = list(torch.empty(1024, self.B, self.D, dtype=self.dtype).unbind(0))
            out = self._outputs.pop()
        return y_BD if y_BD.is_contiguous() else y_BD.contiguous(), out

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

    def step(self, y_BD: torch.Tensor, slot: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Consumes y_t (B, D) for one slot and returns z_t (B, D), in `out` where given: a contiguous (B, D)
        tensor of the engine's dtype and device, e.g. a view of a buffer made once: a fresh output is an
        allocation, a sizable part of a small step."""
        # Checked on every call (a few hundred ns): a wrong shape would broadcast, a wrong slot corrupt silently.
        if (y_BD.shape != self.step_shape or not 0 <= slot < self.G or y_BD.dtype != self.dtype
                or y_BD.device != self.device):
            self._check(y_BD, tuple(self.step_shape), slot)
        if out is not None and (out.shape != self.step_shape or out.dtype != self.dtype or out.device != self.device
                                or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous {tuple(self.step_shape)} tensor of {self.dtype} on "
                             f"{self.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
                             + ("" if out.is_contiguous() else " (not contiguous)"))
        if self.pos >= self.L:
            raise ValueError(f"all {self.L} positions are used; build the engine with a longer filter")
        z_BD = self._step(y_BD, slot, self.pos, out)
        if slot == self.G - 1:
            self.pos += 1
        return z_BD if out is None or z_BD is out else out.copy_(z_BD)

    def tiles_after_position(self, t: int) -> None:  # noqa: B027 (a hook: only flash's steps leave work behind)
        """For a caller that stepped every slot at position t in C itself (decode.NativeDecodeState): the work the
        steps leave to tensor ops, due before position t + 1 (flash's tiles); then it advances `pos` itself."""

    @abc.abstractmethod
    def _prefill_state(self, y_DBP: torch.Tensor, slot: int) -> None: ...

    @abc.abstractmethod
    def _step(self, y_BD: torch.Tensor, slot: int, t: int, out: torch.Tensor | None) -> torch.Tensor:
        """z_t of one slot; a C step writes it into `out` where given (step() copies other results there)."""


class LazyConv(OnlineConv):
    """native_step: at batch 1 the step in C (one pass over the history; see OnlineConv._c_function), None
    (default) where it can be built."""

    name = "lazy"

    def __init__(self, rho_GDL, batch, native_step: bool | None = None):
        super().__init__(rho_GDL, batch)
        # Inputs stored position-major, (D, L, B) per slot, so a step is one (1, t) x (t, B) product per channel,
        # and at B = 1 a product into a preallocated buffer and a sum (faster there than that bmm's batched gemv).
        # No step allocates: per-step (D, B, t) temporaries, between the outputs a caller keeps, fragment the heap
        # and resident memory grows far beyond the engine's buffers.
        self.y_DLB = list(rho_GDL.new_zeros(self.G, self.D, self.L, self.B).unbind(0))
        self.rho_rev = list(rho_GDL.flip(-1).unsqueeze(2).contiguous().unbind(0))  # (D, 1, L) per slot
        self.product_DL = rho_GDL.new_empty(self.D, self.L) if batch == 1 else None
        # In C at batch 1 only: at B > 1 the tensor path's batched matrix-vector product is the faster (steps.c).
        self.c_step = self._c_function(native.lazy_step, native_step if batch == 1 else False)
        self.c_pointers = [(y.data_ptr(), r.data_ptr()) for y, r in zip(self.y_DLB, self.rho_rev)]

    def _prefill_state(self, y_DBP, slot):
        self.y_DLB[slot][:, : y_DBP.shape[-1]] = y_DBP.transpose(1, 2)

    def _step(self, y_BD, slot, t, out):
        if self.c_step is not None:
            y_BD, z_BD = self._c_io(y_BD, out)
            self.c_step(*self.c_pointers[slot], self.D, self.L, t, y_BD.data_ptr(), z_BD.data_ptr())
            return z_BD
        y_DLB = self.y_DLB[slot]
        y_DLB[:, t] = y_BD.T
        rho_D1T = self.rho_rev[slot][..., self.L - 1 - t :]
        if self.product_DL is None:
            return torch.bmm(rho_D1T, y_DLB[:, : t + 1]).squeeze(1).T
        product_DT = torch.mul(rho_D1T[:, 0], y_DLB[:, : t + 1, 0], out=self.product_DL[:, : t + 1])
        return product_DT.sum(-1).unsqueeze(0)


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

    def _step(self, y_BD, slot, t, out):
        acc = self.acc[slot]
        acc[..., t:].addcmul_(y_BD.T.unsqueeze(-1), self.rho[slot][..., : self.L - t])
        return acc[..., t].T.clone()


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

    def _step(self, y_BD, slot, t, out):
        y = self.y[slot]
        y[..., t] = y_BD.T
        n = next_pow2(t + 1)
        return torch.fft.irfft(torch.fft.rfft(y[..., : t + 1], n=n) * self.spectra[n][slot], n=n)[..., t].T


class FlashConv(OnlineConv):
    """Flash Inference. Tiles of size >= block go through tau; the pairs inside one b-aligned block are summed by
    each step eagerly: a step is two small tensor ops on views made once, its output and one multiply-add that
    stores y_t and adds its contribution to the rest of its block.

    batch_layers: True runs each tile once for all slots (they share the tile size), False once per slot, None
    (default) chooses per tile size whichever is faster on this machine (accel.autotune): one call has
    less overhead, G calls keep the working set of a long tile in cache.
    native_step: the step as one C call instead of tensor ops (see OnlineConv._c_function); None (default) where
    it can be built. The C step also does the tiles of size block and 2 block itself (`c_tiles`).
    """

    name = "flash"

    def __init__(self, rho_GDL, batch, tau: str = "hybrid", block: int | None = None,
                 batch_layers: bool | None = None, native_step: bool | None = None):
        super().__init__(rho_GDL, batch)
        self.c_step = self._c_function(native.flash_step, native_step)
        # A step sums its block eagerly (O(block) work) and tiles start at the block size: with tensor ops a step
        # costs its ops, so the block is small; the C step's work is cheap, so it takes over the small tiles
        # (benchmarks/RESULTS.md has the measurements behind 64 and 16).
        block = block or (64 if self.c_step else 16)
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 1, got {block}")
        G, D, B, L = self.G, self.D, self.B, self.L
        self.block = b = block
        # Rows (slot, channel) as tau takes them, one buffer for the past and the future: position p holds the tiles'
        # sums for output p until p's block begins (the step copies them out), then, once the block is complete, the
        # input y_p. A tile after step t reads inputs <= t and adds to outputs > t, and every sum for p arrives
        # before p's block begins, so the two never meet. One buffer instead of two halves the engine's memory (and
        # its working set in cache).
        self.y_rows = self.acc_rows = rho_GDL.new_zeros(G * D, B, L + b)
        self.y_slot = self.acc_slot = self.y_rows.view(G, D, B, L + b)
        # Each slot's current block, position-major: the partial sums of its outputs A, then its inputs Y, in one
        # buffer W = [A_0 .. A_{b-1}, Y_0 .. Y_{b-1}]. At offset o, W[o+1 : o+1+b] is A_{o+1} .. A_{b-1} (which
        # y_o feeds through lags 1 .. b-1-o), Y_0 .. Y_{o-1} (weight 0) and Y_o (weight 1, from zero): one multiply-
        # add per step both sums y_o into its block's later outputs and stores it.
        self.W = rho_GDL.new_zeros(G, 2 * b, B, D)
        self.A, self.Y = self.W[:, :b], self.W[:, b:]
        rho_k = F.pad(rho_GDL[..., :b], (0, max(0, b - L))).transpose(1, 2).unsqueeze(2)  # (G, b, 1, D): lag k
        self.rho0, self.rho_lags = rho_k[:, 0], rho_k[:, 1:]
        weights = rho_GDL.new_zeros(G, b, b, 1, D)  # [g, o]: the weights of W[o+1 : o+1+b]
        for o in range(b):
            weights[:, o, : b - 1 - o] = rho_k[:, 1 : b - o]
            weights[:, o, b - 1] = 1
        self.W_later = [[w[o + 1 : o + 1 + b] for o in range(b)] for w in self.W]
        self.weights = [w.unbind(0) for w in weights]
        self.A_now = [a.unbind(0) for a in self.A]
        self.pending = [False] * G
        """Slots whose block was begun by prefill: its tile sums are still to be added (the C step keeps its own
        flag in its slot's structure)."""
        self.sizes = [U for U in (1 << k for k in range(max(L - 1, 1).bit_length())) if b <= U < L]
        self.tau = build_tau(tau, rho_GDL.reshape(G * D, L))
        for U in self.sizes:
            self.tau.prepare(U)
        self.slot_taus = [self.tau.rows(g * D, (g + 1) * D) for g in range(G)]
        self.batched = {U: (G == 1 or self._batching_wins(U)) if batch_layers is None else batch_layers
                        for U in self.sizes}
        """Tile size -> whether one tau call serves every slot (after the last slot's step)."""
        self.block_mask = b - 1
        self.c_tiles = 2 * b if self.c_step else 0
        """The largest tile size that the C step does itself, after its block (prefill's tiles still use tau): the
        two smallest, where tau's FFTs and their tensor ops cost the most per multiply-add."""
        self.c_slots = self._c_slots() if self.c_step else None

    def _c_slots(self) -> list[int]:
        """The C step's per-slot arguments: addresses of structures (and tensors) that this engine keeps alive."""
        self._rho_GbD = self.rho0.new_zeros(self.G, self.block, self.D)
        self._rho_GbD[:, 0], self._rho_GbD[:, 1:] = self.rho0[:, 0], self.rho_lags[:, :, 0]
        self._filters = self.rho_GDL.contiguous()
        self._c_structs = [native.slot(self.A[g], self.Y[g], self._rho_GbD[g], self.acc_slot[g], self._filters[g],
                                       self.c_tiles) for g in range(self.G)]
        return [ctypes.addressof(s) for s in self._c_structs]

    def _batching_wins(self, U: int) -> bool:
        y_all = self.y_rows[..., :U]
        key = (f"flash tiles {y_all.device.type} {str(y_all.dtype)[6:]} G={self.G} D={self.D} B={self.B} U={U} "
               f"tau={self.tau.name}")
        candidates = {"batched": lambda: self.tau(y_all),
                      "per_slot": lambda: [tau(y_all[g * self.D : (g + 1) * self.D])
                                           for g, tau in enumerate(self.slot_taus)]}
        return autotune.choose(y_all.device, key, candidates) == "batched"

    def describe(self) -> dict[int, str]:
        """Per tile size: the tau that ran it (hybrid's choice, once used) and whether it served every slot."""
        out = {}
        for U in self.sizes:
            if U <= self.c_tiles:
                out[U] = "C, in the step"
                continue
            tau = self.tau if self.batched[U] else self.slot_taus[-1]
            chosen = getattr(tau, "chosen", {}).get(U, tau)
            out[U] = f"{chosen.name}, {'all slots' if self.batched[U] else 'per slot'}"
        return out

    def _tile(self, tau: Tau, y_RBL: torch.Tensor, acc_RBL: torch.Tensor, t: int, U: int, first_out: int) -> None:
        """Adds inputs t-U+1 .. t to outputs max(t+1, first_out) .. min(t+U, L-1)."""
        out_RBU = tau(y_RBL[..., t - U + 1 : t + 1])
        lo, hi = max(t + 1, first_out), min(t + U, self.L - 1)
        acc_RBL[..., lo : hi + 1] += out_RBU[..., lo - t - 1 : hi - t]

    def _tau_tile_after_block(self, t: int) -> int:
        """The size of the tile that tau runs after a C step's block ending at t, or 0: none after the last
        position, and the C step did the smallest ones itself. (Callers test for a block's end first: it is
        one step in `block`, and this is a call.)"""
        return lowbit(t + 1) if t + 1 < self.L and lowbit(t + 1) > self.c_tiles else 0

    def tiles_after_position(self, t: int) -> None:
        if t & self.block_mask == self.block_mask and (U := self._tau_tile_after_block(t)):
            for slot in range(self.G):
                self._tiles_after(slot, t, U, first_out=t + 1)

    def _tiles_after(self, slot: int, t: int, U: int, first_out: int) -> None:
        """The tile of size U launched after slot's step t: its own, or every slot's once the last one has stepped."""
        if not self.batched[U]:
            self._tile(self.slot_taus[slot], self.y_slot[slot], self.acc_slot[slot], t, U, first_out)
        elif slot == self.G - 1:
            self._tile(self.tau, self.y_rows, self.acc_rows, t, U, first_out)

    def _prefill_state(self, y_DBP, slot):
        P, b = y_DBP.shape[-1], self.block
        self.y_slot[slot][..., :P] = y_DBP
        # Of the tiles launched before P, only the last one of each size can reach an output >= P.
        for U in self.sizes:
            odd_multiple = (P // U) - (1 - (P // U) % 2)
            t = odd_multiple * U - 1
            if odd_multiple > 0 and t + U >= P:
                self._tiles_after(slot, t, U, first_out=P)
        # The block holding P: its inputs so far, and their sums for its outputs from P on.
        o, start = P % b, P - P % b
        if o:
            self.Y[slot, :o] = y_DBP[..., start:P].permute(2, 1, 0)
            self.A[slot].zero_()
            self.Y[slot, o:].zero_()
            for j in range(start, P):  # lags P - j .. start + b - 1 - j; rho_lags starts at lag 1
                self.A[slot, o:].addcmul_(y_DBP[..., j].T, self.rho_lags[slot][P - j - 1 : start + b - j - 1])
            self.pending[slot] = True
            if self.c_step:
                self._c_structs[slot].pending = 1

    def _step(self, y_BD, slot, t, out):
        if self.c_step is not None:
            y_BD, z_BD = self._c_io(y_BD, out)
            self.c_step(self.c_slots[slot], t, y_BD.data_ptr(), z_BD.data_ptr())
            if t & self.block_mask == self.block_mask and (U := self._tau_tile_after_block(t)):
                self._tiles_after(slot, t, U, first_out=t + 1)
            return z_BD
        b = self.block
        o = t & (b - 1)
        if o == 0 or self.pending[slot]:
            block_sums = self.acc_slot[slot][..., t - o : t - o + b].permute(2, 1, 0)
            if self.pending[slot]:
                self.A[slot].add_(block_sums)
            else:
                self.A[slot].copy_(block_sums)
                self.Y[slot].zero_()
            self.pending[slot] = False
        z_BD = torch.addcmul(self.A_now[slot][o], y_BD, self.rho0[slot])
        self.W_later[slot][o].addcmul_(y_BD, self.weights[slot][o])
        if o == b - 1 and t + 1 < self.L:
            self.y_slot[slot][..., t - o : t + 1] = self.Y[slot].permute(2, 1, 0)
            self._tiles_after(slot, t, lowbit(t + 1), first_out=t + 1)
        return z_BD


ENGINES: dict[str, type[OnlineConv]] = {e.name: e for e in (LazyConv, EagerConv, RecomputeConv, FlashConv)}


def build_engine(name: str, rho_GDL: torch.Tensor, batch: int, **flash_options) -> OnlineConv:
    """An engine by name; flash_options (tau, block, batch_layers, native_step) go to flash, and native_step to
    lazy too; the others take none."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    allowed = {"flash": flash_options.keys(), "lazy": {"native_step"}}.get(name, set())
    if set(flash_options) - allowed:
        raise ValueError(f"options {sorted(set(flash_options) - allowed)} apply to the flash engine only, "
                         f"not {name!r}")
    return ENGINES[name](rho_GDL, batch, **flash_options)
