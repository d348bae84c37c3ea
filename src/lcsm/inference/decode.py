"""One generated token through a Hyena LM outside its long convolutions, the same for every online engine.

At B x D = 1 x 64 on a CPU a tensor op costs microseconds of dispatch and almost no arithmetic, so a decode step
costs its number of calls. Between one block's last long convolution and the next block's first there is no
choice to make, so all of it is one function, `block_exit`: the last gate, out_proj, the MLP, then the next
block's RMSNorm, in_proj and short conv. A token is the embedding, `block_exit` once per block boundary and the
long convolutions (with one gate multiply between two of them). The embedding enters as the output of a block
whose weights are zero, and the head as a "next block" whose in_proj is the output layer and whose short conv
passes the newest position through, so that one function (one compiled artifact) serves every call.

`block_exit` runs eagerly, or compiled ahead of time by AOTInductor into one fused C++ call (CUDA kernels on a
GPU), which at D=64 on a CPU is several times faster. The weights are rearranged once per decode state, equal to
the modules' arithmetic up to rounding:
- each RMSNorm's weight (and sqrt(D)) is folded into the projection after it; the norm leaves one scale per row;
- in_proj's output channels [d, p] become groups [p, d], so the value and each gate are (B, D) slices;
- the short causal conv runs on a ring of the last K in_proj outputs (zeros before position 0, where the conv's
  zero padding drops in_proj's bias too);
- the MLP's exact gelu is written with erf (see block_exit).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lcsm.inference import autotune
from lcsm.inference.engines import OnlineConv, build_engine
from lcsm.model.hyena import HyenaBlock, HyenaLM


def rms_scale(x_BD: torch.Tensor, D_eps: float) -> torch.Tensor:
    """1 / sqrt(sum x^2 + D eps) per row (B, 1): RMSNorm's scale over sqrt(D), which fold_norm puts in the weight."""
    return torch.linalg.vecdot(x_BD, x_BD).add_(D_eps).rsqrt_().unsqueeze(-1)


def fold_norm(norm: nn.RMSNorm, weight_OD: torch.Tensor) -> torch.Tensor:
    """The (D, O) right factor of `x_scaled @ W` equal to the linear map `weight_OD` applied after `norm`."""
    return (weight_OD * norm.weight * weight_OD.shape[1] ** 0.5).T.contiguous()


def block_exit(x_BD, z_BD, gate_BD, ring_BKGD, out_w_DD, out_b_D, w1_DH, w2_HD, in_w_DGD, in_b_GD, conv_w_KGD,
               conv_b_GD, D_eps: float):
    """A block's output from its input x and its last long convolution z, then the next block's ring of in_proj
    outputs (B, K, G, D) and its short conv's output u (B, G, D): returns (out_BD, ring_BKGD, u_BGD)."""
    h = torch.addmm(x_BD, gate_BD * z_BD, out_w_DD).add_(out_b_D)
    # gelu(a) @ w2 = (a' + a' erf(a')) @ (w2 / sqrt 2) with a' = a / sqrt 2 (folded into w1 and w2): aten's exact
    # gelu runs scalar code on some CPUs (50 us for 256 floats here), its erf is vectorized (5 us).
    a = torch.mm(h, w1_DH).mul_(rms_scale(h, D_eps))
    out = torch.addmm(h, torch.addcmul(a, a, torch.erf(a)), w2_HD)
    projected = torch.addmm(in_b_GD.flatten(), out * rms_scale(out, D_eps), in_w_DGD.flatten(1))
    B, _, _, D = ring_BKGD.shape
    ring = torch.cat([ring_BKGD[:, 1:], projected.view(B, 1, -1, D)], 1)
    return out, ring, torch.sum(ring * conv_w_KGD, 1).add_(conv_b_GD)


class BlockExit(nn.Module):
    """block_exit as a module, for torch.export (D_eps is a constant of the compiled code)."""

    def __init__(self, D_eps: float):
        super().__init__()
        self.D_eps = D_eps

    def forward(self, *tensors):
        return block_exit(*tensors, D_eps=self.D_eps)


class CompileError(RuntimeError):
    """The compiled decode step could not be built (most often: no C++ compiler)."""


def compiled_block_exit(example: tuple[torch.Tensor, ...], D_eps: float):
    """block_exit compiled by AOTInductor for the example's shapes (G, the in_proj groups, left free): built once
    per machine, torch version, dtype and shape, then loaded from $LCSM_CACHE_DIR/decode (a minute to build on a
    CPU). Returns a function of the same tensors, returning a list of the three outputs."""
    if not all(t.is_contiguous() for t in example):
        raise ValueError("the example tensors must be contiguous: the compiled code assumes their strides")
    shapes = " ".join("x".join(map(str, t.shape)) for t in example[:8])
    key = f"{autotune.machine(example[0].device)} | {example[0].dtype} | {shapes} | eps {D_eps!r}"
    path = autotune.cache_file().parent / "decode" / f"block_exit-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt2"
    if not path.is_file():
        print(f"lcsm: compiling the decode step ({shapes.split()[0]} {str(example[0].dtype)[6:]}, "
              f"{example[0].device.type}) once for this machine into {path} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        G = torch.export.Dim("G", min=2)
        dynamic = ((None,) * 3 + ({2: G},) + (None,) * 4 + ({1: G}, {0: G}, {1: G}, {0: G}),)
        try:
            program = torch.export.export(BlockExit(D_eps), example, dynamic_shapes=dynamic)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")  # aoti wants the suffix
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
            tmp.replace(path)  # atomic: a concurrent process loads the old package or the new one
        except Exception as e:
            raise CompileError(f"compiling the decode step failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                               "AOTInductor needs a C++ compiler on the CPU. Decode eagerly instead "
                               "(compiled=False, or --decode eager)") from e
        print(f"lcsm: compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    # The loader's run() takes the flat tensor list; the package's __call__ adds ~35 us of pytree (un)flattening.
    run = torch._inductor.aoti_load_package(str(path)).loader.run

    def compiled(x, z, gate, *rest):
        # The compiled code assumes the example's (contiguous) strides and does not check them; at B > 1 an
        # engine's output and the gate (a view of u) are strided.
        return run([x, z.contiguous(), gate.contiguous(), *rest])

    return compiled


class DecodeBlock:
    """A HyenaBlock's weights in decode layout (a snapshot) and its ring of in_proj outputs."""

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
        """The block's parallel forward over a prompt, its long convolutions through the engine's exact prefill."""
        P, K, G = x_BPD.shape[1], self.K, self.G
        last = block.mixer.in_proj(block.mixer_norm(x_BPD[:, max(P - K, 0) :]))  # channels [d, p]
        self.ring[:, K - last.shape[1] :] = last.unflatten(-1, (-1, G)).transpose(-1, -2)
        return block(x_BPD, long_conv=lambda v, n: engine.prefill(v, slot=first_slot + n))


class DecodeState:
    """What decoding carries from token to token: the long-convolution engine, the blocks' weights in decode layout
    with their rings (a snapshot: build a new state after changing the model) and the position.

    compiled: run block_exit as one AOTInductor call (see compiled_block_exit) rather than eagerly.
    """

    def __init__(self, model: HyenaLM, engine: OnlineConv, batch: int, compiled: bool = False):
        self.model, self.engine, self.pos = model, engine, 0
        eps = {m.eps for m in model.modules() if isinstance(m, nn.RMSNorm)}
        if len(eps) != 1:
            raise ValueError(f"decoding folds every RMSNorm with one eps; this model has {sorted(eps)}")
        D, V = model.args.dim, model.args.vocab_size
        self.D_eps = D * eps.pop()
        self.blocks = [DecodeBlock(block, batch) for block in model.layers.values()]
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
        self.exit = self._eager_exit
        if compiled:
            # Distinct example tensors: inputs that alias each other would be traced as one.
            example = (*(self.zeros.clone() for _ in range(3)), first.ring, *first.post, *first.entry)
            self.exit = compiled_block_exit(example, self.D_eps)

    def _eager_exit(self, *tensors):
        return block_exit(*tensors, D_eps=self.D_eps)

    @torch.no_grad()
    def prefill(self, tokens_BP: torch.Tensor) -> torch.Tensor:
        """Consumes a prompt (B, P) and returns its logits (B, P, vocab), equal to the parallel forward."""
        if self.pos != 0:
            raise ValueError("prefill must come first; build a new decode state for a new sequence")
        h = self.model.tok_embeddings(tokens_BP)
        for i, (block, decode) in enumerate(zip(self.model.layers.values(), self.blocks)):
            h = decode.prefill(block, h, self.engine, i * decode.order)
        self.pos = tokens_BP.shape[1]
        return self.model.output(self.model.norm(h))

    @torch.inference_mode()  # cheaper per op than no_grad; the state's tensors are never read by autograd
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        """Consumes one token per sequence (B,) at position pos and returns the next-token logits (B, vocab)."""
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


@torch.no_grad()
def new_decode_state(model: HyenaLM, engine: str, batch: int, compiled: bool = False,
                     **flash_options) -> DecodeState:
    """A fresh state for `batch` sequences, decoding with the named online engine (see lcsm.inference.engines)."""
    return DecodeState(model, build_engine(engine, model.inference_filters(), batch, **flash_options), batch,
                       compiled)
