"""One generated token through a Hyena LM outside its long convolutions, the same for every online engine.

At B x D = 1 x 64 on a CPU a tensor op costs microseconds of dispatch and almost no arithmetic, so a decode step
costs its number of calls. Three implementations, all equal to the modules' arithmetic up to rounding:
- eager (EagerBlock): 14 tensor calls per block besides its long convolutions, each into a buffer made once;
- compiled (lcsm.inference.block_exit): everything between one block's last long convolution and the next
  block's first (the last gate, out_proj, the MLP, the next block's RMSNorm, in_proj and short conv) is one
  function, compiled ahead of time by AOTInductor into one fused C++ call (CUDA kernels on a GPU). The embedding
  enters as the output of a block whose weights are zero, and the head as a "next block" whose in_proj is the
  output layer and whose short conv passes the newest position through, so that one artifact serves every call;
  it is built once per machine and shape (about 30 s) and cached. Its code still calls ATen for each matmul (and
  allocates its outputs);
- native: the same block_exit in C (lcsm/inference/steps.c, built in about a second), into buffers made once:
  148 us per token outside the long convolutions at 16K, against 316-348 us compiled (D=64, 4 layers, B=1).
  Where the engine's steps are in C too (flash, lazy at B = 1), the whole token is one C call (decode_token:
  the embedding, every boundary, every engine step and the gates between them), and flash's tiles follow it:
  39 us per token outside the long convolutions at 16K (64 in the previous release).
The weights are rearranged once per decode state:
- each RMSNorm's weight (and sqrt(D)) is folded into the projection after it; the norm leaves one scale per row;
- in_proj's output channels [d, p] become groups [p, d], so the value and each gate are (B, D) slices;
- the MLP's exact gelu is written with erf: aten's gelu runs scalar code on some CPUs (50 us for 256 floats
  here), its erf is vectorized (5 us); native's float32 erf is a rational approximation within 4e-7 that
  vectorizes (0.2 us for 256 floats, against 4.5 for libm's erff);
- eager folds the short conv into in_proj (a ring of normalized inputs, in_proj's weight times the conv kernel,
  rotated once per ring position) and out_proj's bias into its matmul; compiled and native run the conv on a
  ring of in_proj outputs (zeros before position 0, where the conv's zero padding drops in_proj's bias too).
"""

from __future__ import annotations

import abc
import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from lcsm.inference import native
from lcsm.inference.block_exit import CompileError, compiled_block_exit, fold_norm, rms_scale
from lcsm.inference.engines import OnlineConv, build_engine
from lcsm.model.hyena import HyenaBlock, HyenaLM


class SquareNorm:
    """`scale()` = rms_scale of a fixed (B, D) buffer, as two ops into a buffer of its own."""

    def __init__(self, x_BD: torch.Tensor, D_eps: float):
        B, D = x_BD.shape
        self.rows, self.cols = x_BD.view(B, 1, D), x_BD.view(B, D, 1)
        self.D_eps = x_BD.new_full((1, 1, 1), D_eps)
        self.out = x_BD.new_empty(B, 1, 1)
        self.out_B1 = self.out.view(B, 1)

    def scale(self) -> torch.Tensor:
        torch.baddbmm(self.D_eps, self.rows, self.cols, out=self.out)
        return self.out_B1.rsqrt_()


class EagerBlock:
    """A HyenaBlock's weights in eager decode layout (a snapshot) and the buffers of its one-token step: 14 tensor
    calls besides the long convolutions, into buffers made once (with their views)."""

    def __init__(self, block: HyenaBlock, batch: int):
        mixer, B = block.mixer, batch
        D, N, K = mixer.out_proj.weight.shape[0], mixer.order, mixer.short_weight.shape[-1]
        self.order, self.K = N, K
        # in_proj's output channels are [d, p]; here [p, d], so that the value and each gate are (B, D) views.
        perm = torch.arange((N + 1) * D, device=mixer.in_proj.weight.device).view(D, N + 1).T.reshape(-1)
        in_w = fold_norm(block.mixer_norm, mixer.in_proj.weight)[:, perm]  # (D, C)
        w_CK, in_b = mixer.short_weight.squeeze(1)[perm], mixer.in_proj.bias[perm]
        # Ring slot j holds position t - ((r - j) mod K) at a step with t mod K = r; lag l takes w[K - 1 - l].
        j = torch.arange(K, device=w_CK.device)
        weight_rjC = w_CK[:, K - 1 - (j[:, None] - j[None, :]) % K].permute(1, 2, 0)  # [r, j, c]
        self.in_w = (in_w[None, None] * weight_rjC[:, :, None]).flatten(1, 2).contiguous()  # (K, K D, C)
        # The conv's zero padding before position 0 drops in_proj's bias there: one bias per t < K - 1, then all.
        lags = torch.arange(K, device=w_CK.device)
        self.in_b = torch.stack([mixer.short_bias[perm] + in_b * w_CK[:, K - 1 - lags[: t + 1]].sum(-1)
                                 for t in range(K)])
        self.out_w = torch.cat([mixer.out_proj.weight.T, mixer.out_proj.bias[None]]).contiguous()  # (D + 1, D)
        # gelu(a) @ w2 = (a' + a' erf(a')) @ (w2 / sqrt 2) with a' = a / sqrt 2, folded into w1 and w2.
        self.w1 = fold_norm(block.mlp_norm, block.mlp.w1.weight) * 0.5**0.5
        self.w2 = block.mlp.w2.weight.T.contiguous() * 0.5**0.5
        new = self.w2.new_zeros
        self.ring = new(B, K, D)
        """Normalized block inputs x * rms_scale(x), position tau at slot tau mod K; zeros before position 0."""
        self.ring_flat, self.ring_slots = self.ring.view(B, K * D), self.ring.unbind(1)
        self.u = new(B, N + 1, D)
        self.u_flat, self.u_parts = self.u.view(B, -1), self.u.unbind(1)
        self.v_ones = new(B, D + 1)
        self.v_ones[:, D] = 1
        self.v_last = self.v_ones[:, :D]
        self.h, self.a, self.out = new(B, D), new(B, self.w1.shape[1]), new(B, D)
        self.norm_in, self.norm_h = None, SquareNorm(self.h, D * block.mlp_norm.eps)
        self.mixer_D_eps = D * block.mixer_norm.eps

    def bind_input(self, x_BD: torch.Tensor) -> None:
        """The buffer this block reads its input from (the previous block's `out`, or the embedding's)."""
        self.x, self.norm_in = x_BD, SquareNorm(x_BD, self.mixer_D_eps)

    def step(self, t: int, engine: OnlineConv, first_slot: int) -> None:
        """Block output for position t into `self.out`; steps engine slots first_slot .. first_slot + order - 1."""
        r = t % self.K
        torch.mul(self.x, self.norm_in.scale(), out=self.ring_slots[r])
        torch.addmm(self.in_b[min(t, self.K - 1)], self.ring_flat, self.in_w[r], out=self.u_flat)
        v, *gates = self.u_parts
        for n, gate in enumerate(gates):
            z = engine.step(v, first_slot + n)
            v = torch.mul(gate, z, out=self.v_last) if n == self.order - 1 else gate * z
        torch.addmm(self.x, self.v_ones, self.out_w, out=self.h)
        a = torch.mm(self.h, self.w1, out=self.a).mul_(self.norm_h.scale())
        torch.addmm(self.h, torch.addcmul(a, a, torch.erf(a)), self.w2, out=self.out)

    def prefill(self, block: HyenaBlock, x_BPD: torch.Tensor, engine: OnlineConv, first_slot: int) -> torch.Tensor:
        P = x_BPD.shape[1]
        for tau in range(max(P - self.K, 0), P):
            x = x_BPD[:, tau]
            self.ring_slots[tau % self.K].copy_(x * rms_scale(x, self.mixer_D_eps))
        return block(x_BPD, long_conv=lambda v, n: engine.prefill(v, slot=first_slot + n))


class ExitBlock:
    """A HyenaBlock's weights in block_exit's layout (a snapshot) and its ring of in_proj outputs."""

    def __init__(self, block: HyenaBlock, batch: int):
        mixer = block.mixer
        D, N, K = mixer.out_proj.weight.shape[0], mixer.order, mixer.short_weight.shape[-1]
        self.order, self.K, self.G = N, K, N + 1
        # in_proj's output channels are [d, p]; here [p, d], so that the value and each gate are (B, D) slices.
        perm = torch.arange((N + 1) * D, device=mixer.in_proj.weight.device).view(D, N + 1).T.reshape(-1)
        self.entry = (fold_norm(block.mixer_norm, mixer.in_proj.weight)[:, perm].view(D, N + 1, D),
                      mixer.in_proj.bias[perm].view(N + 1, D),
                      mixer.short_weight.squeeze(1)[perm].T.reshape(K, N + 1, D).contiguous(),
                      mixer.short_bias[perm].view(N + 1, D))
        """Its weights at the end of block_exit: in_proj's (D, G, D) and bias, the short conv's (K, G, D) and bias."""
        self.post = (mixer.out_proj.weight.T.contiguous(), mixer.out_proj.bias.clone(),
                     fold_norm(block.mlp_norm, block.mlp.w1.weight) * 0.5**0.5,
                     block.mlp.w2.weight.T.contiguous() * 0.5**0.5)
        """Its weights at the start of block_exit: out_proj's (D, D) and bias, the MLP's."""
        self.ring = self.post[0].new_zeros(batch, K, N + 1, D)
        """in_proj outputs of positions t - K .. t - 1 before step t, oldest first; zeros before position 0."""

    def prefill(self, block: HyenaBlock, x_BPD: torch.Tensor, engine: OnlineConv, first_slot: int) -> torch.Tensor:
        P, K, G = x_BPD.shape[1], self.K, self.G
        last = block.mixer.in_proj(block.mixer_norm(x_BPD[:, max(P - K, 0) :]))  # channels [d, p]
        self.ring[:, K - last.shape[1] :] = last.unflatten(-1, (-1, G)).transpose(-1, -2)
        return block(x_BPD, long_conv=lambda v, n: engine.prefill(v, slot=first_slot + n))


class DecodeState(abc.ABC):
    """What decoding carries from token to token: the long-convolution engine, the blocks' weights in decode layout
    with their buffers (a snapshot: build a new state after changing the model) and the position."""

    def __init__(self, model: HyenaLM, engine: OnlineConv, blocks: list):
        self.model, self.engine, self.pos, self.blocks = model, engine, 0, blocks

    @torch.no_grad()
    def prefill(self, tokens_BP: torch.Tensor) -> torch.Tensor:
        """Consumes a prompt (B, P) and returns its logits (B, P, vocab), equal to the parallel forward."""
        if self.pos != 0:
            raise ValueError("prefill must come first; build a new decode state for a new sequence")
        h = self.model.tok_embeddings(tokens_BP)
        for i, (block, decode) in enumerate(zip(self.model.layers.values(), self.blocks)):
            # The block's parallel forward, its long convolutions through the engine's exact prefill; decode fills
            # its ring from the last positions.
            h = decode.prefill(block, h, self.engine, i * decode.order)
        self.pos = tokens_BP.shape[1]
        return self.model.output(self.model.norm(h))

    @abc.abstractmethod
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        """Consumes one token per sequence (B,) at position pos and returns the next-token logits (B, vocab)."""


def norm_D_eps(model: HyenaLM) -> float:
    """D x the eps that every RMSNorm of the model shares (decoding folds them all with one)."""
    eps = {m.eps for m in model.modules() if isinstance(m, nn.RMSNorm)}
    if len(eps) != 1:
        raise ValueError(f"decoding folds every RMSNorm with one eps; this model has {sorted(eps)}")
    return model.args.dim * eps.pop()


class EagerDecodeState(DecodeState):
    """Decoding with EagerBlocks: the fewest tensor calls, each into a buffer of its own."""

    def __init__(self, model: HyenaLM, engine: OnlineConv, batch: int):
        super().__init__(model, engine, [EagerBlock(block, batch) for block in model.layers.values()])
        emb = model.tok_embeddings.weight
        self.embedded = emb.new_zeros(batch, emb.shape[1])
        x = self.embedded
        for block in self.blocks:
            block.bind_input(x)
            x = block.out
        self.head_w = fold_norm(model.norm, model.output.weight)
        self.head_norm = SquareNorm(x, x.shape[1] * model.norm.eps)

    @torch.inference_mode()  # cheaper per op than no_grad; the state's tensors are only ever updated in place
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        torch.index_select(self.model.tok_embeddings.weight, 0, token_B, out=self.embedded)
        for i, block in enumerate(self.blocks):
            block.step(self.pos, self.engine, i * block.order)
        self.pos += 1
        return torch.mm(self.blocks[-1].out, self.head_w).mul_(self.head_norm.scale())


class CompiledDecodeState(DecodeState):
    """Decoding with block_exit compiled by AOTInductor (see compiled_block_exit): one C++ call per block boundary."""

    def __init__(self, model: HyenaLM, engine: OnlineConv, batch: int):
        super().__init__(model, engine, [ExitBlock(block, batch) for block in model.layers.values()])
        D, V = model.args.dim, model.args.vocab_size
        first = self.blocks[0]
        self.zeros = first.ring.new_zeros(batch, D)
        self.identity = tuple(torch.zeros_like(w) for w in first.post)
        """The weights of a block that passes its input through: the embedding enters block 0 as its output."""
        # The head: an in_proj of G = ceil(V / D) groups (zero-padded vocabulary), a short conv passing the newest
        # position through, and a ring of its own.
        G = -(-V // D)
        head_w = F.pad(fold_norm(model.norm, model.output.weight), (0, G * D - V)).view(D, G, D)
        conv_w = first.ring.new_zeros(first.K, G, D)
        conv_w[-1] = 1
        self.head = (head_w, torch.zeros_like(head_w[0]), conv_w, torch.zeros_like(head_w[0]))
        self.head_ring = first.ring.new_zeros(batch, first.K, G, D)
        self._build_exit(first, norm_D_eps(model))

    def _build_exit(self, first: ExitBlock, D_eps: float) -> None:
        # Distinct example tensors: inputs that alias each other would be traced as one.
        example = (*(self.zeros.clone() for _ in range(3)), first.ring, *first.post, *first.entry)
        self.exit = compiled_block_exit(example, D_eps)

    @torch.inference_mode()
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        x, z, gate = F.embedding(token_B, self.model.tok_embeddings.weight), self.zeros, self.zeros
        post, engine = self.identity, self.engine
        for i, block in enumerate(self.blocks):
            x, block.ring, u = self.exit(x, z, gate, block.ring, *post, *block.entry)
            v, *gates = u.unbind(1)
            for n, gate in enumerate(gates):
                z = engine.step(v, i * block.order + n)
                if n < block.order - 1:
                    v = gate * z
            post = block.post
        _, self.head_ring, logits = self.exit(x, z, gate, self.head_ring, *post, *self.head)
        self.pos += 1
        return logits.flatten(1)[:, : self.model.args.vocab_size]


class NativeDecodeState(CompiledDecodeState):
    """Decoding with block_exit in C (lcsm.inference.native, built in about a second): one call per block boundary
    into buffers made once, without AOTInductor's per-matmul ATen calls."""

    def _build_exit(self, first: ExitBlock, D_eps: float) -> None:
        self.c_exit = native.block_exit(first.ring.device, first.ring.dtype)
        if self.c_exit is None:
            raise CompileError(f"the C decode step needs float32 or float64 on a CPU and a C compiler (cc, gcc or "
                               f"clang, or $CC); got {first.ring.dtype} on {first.ring.device.type}. Decode eagerly "
                               "or compiled instead (--decode eager or compiled)")
        posts = [self.identity] + [b.post for b in self.blocks]
        entries = [b.entry for b in self.blocks] + [self.head]
        rings = [b.ring for b in self.blocks] + [self.head_ring]
        self.c_sites = [native.block_exit_args(post, entry, ring, D_eps)
                        for post, entry, ring in zip(posts, entries, rings)]
        self.c_site_addresses = [ctypes.addressof(args) for args, _ in self.c_sites]
        # Each boundary's outputs, reused from token to token (with their views and addresses): x feeds the next
        # call only, u the engine (which copies its inputs) and the gates. The logits are fresh: the caller keeps
        # them.
        B, D = self.zeros.shape
        self.c_out = [self.zeros.new_empty(B, D) for _ in rings]
        self.c_u = [self.zeros.new_empty(B, ring.shape[2], D) for ring in rings[:-1]]
        self.c_u_parts = [u.unbind(1) for u in self.c_u]
        self.c_out_ptrs, self.c_u_ptrs = [t.data_ptr() for t in self.c_out], [t.data_ptr() for t in self.c_u]
        self.c_token = self._c_token()

    def _c_token(self):
        """The whole token in one C call where the engine steps in C (flash, or lazy at B = 1), instead of one per
        boundary and one per engine step (13 at 4 layers of order 2) with tensor ops between them. None otherwise:
        the token then goes boundary by boundary."""
        engine = self.engine
        if getattr(engine, "c_step", None) is None:  # only flash and lazy have C steps
            return None
        decode = native.decode_token(engine.device, engine.dtype)
        embedding = self.model.tok_embeddings.weight.detach()  # holds the storage even if the model's is replaced
        if decode is None or not embedding.is_contiguous() or embedding.dtype != engine.dtype:
            return None
        flash, lazy = (engine.c_slots, None) if engine.name == "flash" else (None, engine.c_pointers)
        self.c_token_args, self._c_token_buffers = native.decode_token_args(
            embedding, self.c_site_addresses, self.c_out, self.c_u, [b.order for b in self.blocks],
            flash, lazy, engine.L)
        self._c_embedding = embedding
        self.c_token_address = ctypes.addressof(self.c_token_args)
        return decode

    def _exit(self, site: int, x, z, gate, u_ptr: int):
        # Named, so that the copies live until the call returns (at B > 1 the gates are strided views).
        z, gate = z.contiguous(), gate.contiguous()
        self.c_exit(self.c_site_addresses[site], x.data_ptr(), z.data_ptr(), gate.data_ptr(),
                    self.c_out_ptrs[site], u_ptr)
        return self.c_out[site]

    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        if self.c_token is None:
            return self._step_by_boundary(token_B)
        engine, t, B = self.engine, self.engine.pos, self.zeros.shape[0]
        if t >= engine.L:
            raise ValueError(f"all {engine.L} positions are used; build the engine with a longer filter")
        if token_B.shape != (B,) or token_B.device != engine.device or token_B.is_floating_point():
            raise ValueError(f"tokens must be integers of shape ({B},) on {engine.device}, got {token_B.dtype} "
                             f"{tuple(token_B.shape)} on {token_B.device}")
        tokens = token_B.to(torch.int64).contiguous()  # named: C reads it during the call
        logits = self.zeros.new_empty(B, self.head_ring.shape[2] * self.zeros.shape[1])
        if self.c_token(self.c_token_address, t, tokens.data_ptr(), logits.data_ptr()):
            raise ValueError(f"tokens must be in [0, {self.model.args.vocab_size}), got {token_B.tolist()}")
        engine.tiles_after_position(t)
        engine.pos += 1
        self.pos += 1
        return logits[:, : self.model.args.vocab_size]

    @torch.inference_mode()
    def _step_by_boundary(self, token_B: torch.Tensor) -> torch.Tensor:
        x, z, gate = F.embedding(token_B, self.model.tok_embeddings.weight), self.zeros, self.zeros
        engine = self.engine
        for i, block in enumerate(self.blocks):
            x = self._exit(i, x, z, gate, self.c_u_ptrs[i])
            v, *gates = self.c_u_parts[i]
            for n, gate in enumerate(gates):
                z = engine.step(v, i * block.order + n)
                if n < block.order - 1:
                    v = gate * z
        logits = self.zeros.new_empty(self.head_ring.shape[0], self.head_ring.shape[2] * self.zeros.shape[1])
        self._exit(len(self.blocks), x, z, gate, logits.data_ptr())
        self.pos += 1
        return logits[:, : self.model.args.vocab_size]


DECODES = {"eager": EagerDecodeState, "compiled": CompiledDecodeState, "native": NativeDecodeState}


def default_decode(model: nn.Module) -> str:
    """native where it can be built (a HyenaLM with float32 or float64 weights on a CPU with a C compiler), else
    eager."""
    weight = model.tok_embeddings.weight
    return "native" if isinstance(model, HyenaLM) and native.available(weight.device, weight.dtype) else "eager"


@torch.no_grad()
def new_decode_state(model: nn.Module, engine: str, batch: int, decode: str = "eager", length: int | None = None,
                     **flash_options) -> DecodeState:
    """A fresh state for `batch` sequences of the model (a HyenaLM or a HyenaDNA), decoding with the named online
    engine (see lcsm.inference.engines) over `length` positions (default: the filters' full length).
    decode: the step outside the long convolutions, "eager" (EagerBlocks), "compiled" (block_exit compiled by
    AOTInductor, built once per machine and shape) or "native" (block_exit in C); a HyenaDNA decodes eagerly."""
    from lcsm.inference.dna_decode import DNADecodeState  # it builds on DecodeState, defined here

    if decode not in DECODES:
        raise ValueError(f"unknown decode {decode!r}; choose one of {', '.join(DECODES)}")
    dna = not isinstance(model, HyenaLM)
    if dna and decode != "eager":
        raise ValueError(f"decode {decode!r} folds a HyenaLM's weights; a {type(model).__name__} decodes eagerly")
    engine = build_engine(engine, model.inference_filters(length), batch, **flash_options)
    return (DNADecodeState if dna else DECODES[decode])(model, engine, batch)
