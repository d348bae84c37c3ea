"""One generated token through a Hyena LM outside its long convolutions, the same for every online engine: the
plain torch path (decode="eager"), which the accelerated decode steps of lcsm.inference.accel.decode
(decode="compiled" and "native") are tested against.

At batch 1 a decode step's tensor ops do little arithmetic each, so a step costs about its number of calls: an
EagerBlock's step is 14 tensor calls besides its long convolutions, each into a buffer made once (with its views).
The weights are rearranged once per decode state:
- each RMSNorm's weight (and sqrt(D)) is folded into the projection after it; the norm leaves one scale per row;
- in_proj's output channels [d, p] become groups [p, d], so the value and each gate are (B, D) slices;
- the MLP's exact gelu is written with erf, which aten vectorizes on CPUs where its gelu runs scalar code;
- the short conv is folded into in_proj (a ring of normalized inputs, in_proj's weight times the conv kernel,
  rotated once per ring position) and out_proj's bias into its matmul.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from lcsm.inference import accel
from lcsm.inference.accel import native
from lcsm.inference.engines import OnlineConv, build_engine
from lcsm.model.hyena import HyenaBlock, HyenaLM


def rms_scale(x_BD: torch.Tensor, D_eps: float) -> torch.Tensor:
    """1 / sqrt(sum x^2 + D eps) per row (B, 1): RMSNorm's scale over sqrt(D), which fold_norm puts in the weight."""
    return torch.linalg.vecdot(x_BD, x_BD).add_(D_eps).rsqrt_().unsqueeze(-1)


def fold_norm(norm: nn.RMSNorm, weight_OD: torch.Tensor) -> torch.Tensor:
    """The (D, O) right factor of `x_scaled @ W` equal to the linear map `weight_OD` applied after `norm`."""
    return (weight_OD * norm.weight * weight_OD.shape[1] ** 0.5).T.contiguous()


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


DECODES = ("eager", "compiled", "native")
"""The decode steps: eager here, compiled and native in lcsm.inference.accel.decode."""


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
    from lcsm.inference.accel.decode import ACCEL_DECODES  # these build on DecodeState, defined here
    from lcsm.inference.dna_decode import DNADecodeState

    if decode not in DECODES:
        raise ValueError(f"unknown decode {decode!r}; choose one of {', '.join(DECODES)}")
    dna = not isinstance(model, HyenaLM)
    if dna and decode != "eager":
        raise ValueError(f"decode {decode!r} folds a HyenaLM's weights; a {type(model).__name__} decodes eagerly")
    if decode != "eager" and not accel.enabled():
        raise ValueError(f"decode {decode!r} is an acceleration, and LCSM_ACCEL=0 turns them off; decode eagerly")
    engine = build_engine(engine, model.inference_filters(length), batch, **flash_options)
    state = DNADecodeState if dna else EagerDecodeState if decode == "eager" else ACCEL_DECODES[decode]
    return state(model, engine, batch)
