"""Decode steps of a Hyena LM faster than lcsm.inference.decode's eager one, equal to it up to rounding:
- compiled (decode="compiled"): everything between one block's last long convolution and the next block's first
  (the last gate, out_proj, the MLP, the next block's RMSNorm, in_proj and short conv) is one function,
  block_exit, compiled ahead of time by AOTInductor into one fused C++ call (CUDA kernels on a GPU). The embedding
  enters as the output of a block whose weights are zero, and the head as a "next block" whose in_proj is the
  output layer and whose short conv passes the newest position through, so that one artifact serves every call;
  it is built once per machine and shape and cached. Its code still calls ATen for each matmul (and allocates its
  outputs);
- native (decode="native"): the same block_exit in C (steps.c, built in about a second), into buffers made once.
  Where the engine's steps are in C too (flash, lazy at B = 1), the whole token is one C call (decode_token: the
  embedding, every boundary, every engine step and the gates between them), and flash's tiles follow it.
Both run the short conv on a ring of in_proj outputs (zeros before position 0, where the conv's zero padding drops
in_proj's bias too); native's float32 erf is a rational approximation within 4e-7 that vectorizes.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from lcsm.inference.accel import native
from lcsm.inference.accel.block_exit import CompileError, compiled_block_exit
from lcsm.inference.decode import DecodeState, fold_norm, norm_D_eps
from lcsm.inference.engines import OnlineConv
from lcsm.model.hyena import HyenaBlock, HyenaLM


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
    """Decoding with block_exit in C (accel.native, built in about a second): one call per block boundary
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


ACCEL_DECODES = {"compiled": CompiledDecodeState, "native": NativeDecodeState}
