"""DeepSeek-V3's multi-head latent attention (MLA), with YaRN rotary scaling (titan.models.common.rope).

Keys and values come from a low-rank latent (kv_lora_rank) shared by all heads; queries optionally too
(q_lora_rank, 0 = a full projection). Each head's query/key is a part without position (qk_nope_head_dim) and a
rotary part (qk_rope_head_dim) whose key half is shared by all heads; values have their own width (v_head_dim).
The rotary part is rotated in consecutive (even, odd) pairs, the layout of DeepSeek's checkpoints (transformers'
rope_interleave=True).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.decoder import causal_attention
from titan.models.common.rope import YaRN, apply_rotary, yarn_mscale
from titan.tools.cli import UserError


@dataclass
class MLAArgs:
    n_heads: int = 16
    q_lora_rank: int = 0
    """0: queries by one full projection (DeepSeek-V3 16B / V2-Lite); else through a normed latent of this rank."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise UserError(f"mla {name} must be > 0, got {getattr(self, name)}")
        if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise UserError(f"mla q_lora_rank must be >= 0 and qk_rope_head_dim even, got {self.q_lora_rank}, "
                            f"{self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class CausalAttention(nn.Module):
    """Causal SDPA over (B, heads, T, head_dim) with a given scale, a module of its own so that tensor parallel
    can hand it each rank's heads as plain tensors (DTensor has no rule for the CPU attention kernel) while the
    projections around it stay DTensors."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Flash kernels (the CPU's among them, so context parallel's ring too) take one head size for q, k and v:
        # zeros pad the narrower ones (q.k and the scale unchanged) and are cut from the output.
        v_width, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return causal_attention(q, k, v, scale=self.scale)[..., :v_width]


class MLA(nn.Module):
    def __init__(self, dim: int, args: MLAArgs, yarn: YaRN):
        super().__init__()
        self.args = args
        qk = args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(dim, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, dim, bias=False)
        # YaRN sharpens the softmax by mscale(factor, mscale_all_dim)^2 (1 for plain RoPE).
        self.inner_attention = CausalAttention(
            qk**-0.5 * yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2 if yarn.mscale_all_dim else qk**-0.5)

    def forward(self, x_BTD: torch.Tensor, rope_TH2: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        a = self.args
        q = self.wq_b(self.q_norm(self.wq_a(x_BTD))) if a.q_lora_rank else self.wq(x_BTD)
        # -1 heads: as many as the projection gives (under tensor parallel a DTensor of all heads, split by rank).
        q_nope, q_rope = q.view(B, T, -1, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv, k_rope = self.wkv_a(x_BTD).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_nope, v = self.wkv_b(self.kv_norm(kv)).view(B, T, -1, a.qk_nope_head_dim + a.v_head_dim).split(
            [a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k_rope = apply_rotary(k_rope.view(B, T, 1, a.qk_rope_head_dim), rope_TH2, interleaved=True)
        q = torch.cat((q_nope, apply_rotary(q_rope, rope_TH2, interleaved=True)), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def init_weights(self, init_std: float) -> None:
        linears = [self.wkv_a, self.wkv_b] + ([self.wq_a, self.wq_b] if self.args.q_lora_rank else [self.wq])
        for linear in linears:
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        for norm in (self.kv_norm, getattr(self, "q_norm", None)):
            if norm is not None:
                norm.reset_parameters()
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
