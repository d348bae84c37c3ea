"""One generated token through a Hyena LM outside its long convolutions, the same for every online engine.

At B x D = 1 x 64 on a CPU a decode step's tensor ops cost microseconds of dispatch each and almost no arithmetic,
so its cost is the number of ops (and module calls) per block. The weights are rearranged once per decode state so
that a block needs about 20 plain tensor calls, equal to the modules' arithmetic up to rounding:
- each RMSNorm's weight (and sqrt(D)) is folded into the projection after it, leaving one scale per row per token
  (nn.RMSNorm runs several aten ops per call);
- the short conv's window is a ring buffer that in_proj's matmul writes in place, with the kernel rotated once for
  each ring position, instead of a new concatenated window per token;
- the residual adds ride on the addmm of out_proj and of the MLP's second projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm.inference.engines import OnlineConv


def rms_scale(x_BD: torch.Tensor, D_eps: float) -> torch.Tensor:
    """1 / sqrt(sum x^2 + D eps) per row (B, 1): RMSNorm's scale over sqrt(D), which fold_norm puts in the weight."""
    return torch.linalg.vecdot(x_BD, x_BD).add_(D_eps).rsqrt_().unsqueeze(-1)


def fold_norm(norm: nn.RMSNorm, weight_OD: torch.Tensor) -> torch.Tensor:
    """The (D, O) right factor of `x_scaled @ W` equal to the linear map `weight_OD` applied after `norm`."""
    return (weight_OD * norm.weight * weight_OD.shape[1] ** 0.5).T.contiguous()


def ring_window(u_BCP: torch.Tensor, K: int) -> torch.Tensor:
    """The short conv's ring (K, B, C) after inputs 0 .. P-1: u_tau at slot tau mod K, zeros before the start."""
    P = u_BCP.shape[-1]
    last_KBC = F.pad(u_BCP, (max(K - P, 0), 0))[..., -K:].permute(2, 0, 1)
    return last_KBC.roll(P % K, 0).contiguous()


@dataclass
class BlockWeights:
    """A HyenaBlock's weights laid out for one-token steps; `x @ W` factors are (in, out)."""

    order: int
    D_eps: float
    """dim x RMSNorm eps, as rms_scale takes it."""
    in_w: torch.Tensor
    in_b: torch.Tensor
    short_w: torch.Tensor
    """(K, K, 1, C): [r] weighs the ring slots at a step t with t mod K = r."""
    short_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor

    @classmethod
    def of(cls, block: nn.Module) -> BlockWeights:
        mixer = block.mixer
        D = mixer.out_proj.weight.shape[0]
        w_CK = mixer.short_weight.squeeze(1)
        K = w_CK.shape[-1]
        # u_t = sum_k w[k] u_{t-K+1+k}, and u_{t-K+1+k} sits in ring slot (t+1+k) mod K: slot j takes w[(j-t-1) mod K].
        k = torch.arange(K, device=w_CK.device)
        lag = (k[None, :] - k[:, None] - 1) % K  # [r, j]
        return cls(
            order=mixer.order,
            D_eps=D * block.mixer_norm.eps,
            in_w=fold_norm(block.mixer_norm, mixer.in_proj.weight),
            in_b=mixer.in_proj.bias.clone(),
            short_w=w_CK[:, lag].permute(1, 2, 0).unsqueeze(2).contiguous(),
            short_b=mixer.short_bias.clone(),
            out_w=mixer.out_proj.weight.T.contiguous(),
            out_b=mixer.out_proj.bias.clone(),
            w1=fold_norm(block.mlp_norm, block.mlp.w1.weight),
            w2=block.mlp.w2.weight.T.contiguous(),
        )

    def step(self, x_BD: torch.Tensor, ring_KBC: torch.Tensor, t: int, engine: OnlineConv,
             first_slot: int) -> torch.Tensor:
        """Block output for position t; steps the engine's slots first_slot .. first_slot + order - 1."""
        r = t % ring_KBC.shape[0]
        torch.addmm(self.in_b, x_BD * rms_scale(x_BD, self.D_eps), self.in_w, out=ring_KBC[r])
        u_BC = torch.linalg.vecdot(ring_KBC, self.short_w[r], dim=0).add_(self.short_b)
        v, *gates = u_BC.view(x_BD.shape[0], -1, self.order + 1).unbind(-1)
        for n, gate in enumerate(gates):
            v = gate * engine.step(v, first_slot + n)
        h = torch.addmm(x_BD + self.out_b, v, self.out_w)
        return torch.addmm(h, F.gelu(torch.mm(h * rms_scale(h, self.D_eps), self.w1)), self.w2)


@dataclass
class DecodeState:
    """What decoding carries from token to token: the long-convolution engine, each block's short-conv ring, the
    weights in decode layout (a snapshot: build a new state after changing the model) and the position."""

    engine: OnlineConv
    short: list[torch.Tensor]
    """Per block, the ring (K, B, (order + 1) dim) of in_proj outputs: position tau at slot tau mod K."""
    blocks: list[BlockWeights]
    head_w: torch.Tensor
    """The output projection with the final norm's weight folded in (dim, vocab)."""
    head_D_eps: float
    pos: int = 0
    """The position the next step consumes."""

    def step(self, h_BD: torch.Tensor) -> torch.Tensor:
        """Embedded token (B, D) at position pos -> next-token logits (B, vocab)."""
        for i, block in enumerate(self.blocks):
            h_BD = block.step(h_BD, self.short[i], self.pos, self.engine, i * block.order)
        self.pos += 1
        return torch.mm(h_BD * rms_scale(h_BD, self.head_D_eps), self.head_w)
