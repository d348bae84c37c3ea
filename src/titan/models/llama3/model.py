"""Llama 3.x as plain single-device PyTorch: RMSNorm, RoPE (optionally with Llama 3.1's frequency scaling), GQA
via SDPA, SwiGLU, optionally tied input and output embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan.tools.cli import UserError


@dataclass
class ModelArgs:
    """Every architecture field of a Llama 3.x Hugging Face config.json has a counterpart here."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    hidden_dim: int = 0
    """Explicit SwiGLU hidden size (HF intermediate_size); 0 = derived from multiple_of and ffn_dim_multiplier."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Literal["none", "llama3"] = "llama3"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    """Context length before the llama3 rescaling (HF original_max_position_embeddings)."""
    tie_embeddings: bool = False
    max_context_len: int = 131072
    """Context the weights are made for (HF max_position_embeddings); exported, not used by training."""
    max_seq_len: int = 131072
    """Length of the RoPE table built (the training sequence length)."""

    def __post_init__(self) -> None:
        kv = self.n_kv_heads or self.n_heads
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len", "max_context_len"):
            if getattr(self, name) <= 0:
                raise UserError(f"model {name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise UserError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % kv:
            raise UserError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {kv}; pick a divisor")
        if self.head_dim % 2:
            raise UserError(f"head dim {self.head_dim} (dim / n_heads) must be even for RoPE")
        if self.hidden_dim < 0 or self.norm_eps <= 0 or self.rope_theta <= 0:
            raise UserError(f"model hidden_dim must be >= 0 and norm_eps, rope_theta > 0, got {self.hidden_dim}, "
                             f"{self.norm_eps}, {self.rope_theta}")
        if self.rope_scaling == "llama3":
            if not (self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
                raise UserError(f"llama3 rope scaling needs factor >= 1 and 0 < low_freq_factor < "
                                 f"high_freq_factor, got {self.rope_factor}, {self.rope_low_freq_factor}, "
                                 f"{self.rope_high_freq_factor}")
            if self.rope_original_max_seq_len <= 0:
                raise UserError(f"rope original context must be > 0, got {self.rope_original_max_seq_len}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim:
            return self.hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Per-pair rotation frequencies (head_dim/2,) in fp32, as Meta's reference and transformers compute them,
    with Llama 3.1's long-context rescaling when rope_scaling is llama3."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    if args.rope_scaling == "none":
        return freqs
    factor, low, high = args.rope_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_context = args.rope_original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / freqs
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context / wavelen - low) / (high - low)
    mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_cache(args: ModelArgs, seq_len: int) -> torch.Tensor:
    """(seq_len, head_dim/2, 2) cos/sin table; a real buffer so it can be sharded for context parallel."""
    angles_TH = torch.outer(torch.arange(seq_len, dtype=torch.float32), rope_frequencies(args))
    return torch.stack((angles_TH.cos(), angles_TH.sin()), dim=-1)


def apply_rotary(x_BTHD: torch.Tensor, rope_TH2: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive (even, odd) pairs of each head dimension, as Meta's reference does."""
    B, T, H, D = x_BTHD.shape
    # At least fp32 (fp64 stays fp64, so that fp64 runs compare exactly with other implementations).
    x = x_BTHD.to(torch.promote_types(x_BTHD.dtype, torch.float32)).reshape(B, T, H, D // 2, 2)
    cos = rope_TH2[:T, None, :, 0]
    sin = rope_TH2[:T, None, :, 1]
    real = x[..., 0] * cos - x[..., 1] * sin
    imag = x[..., 0] * sin + x[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(3).type_as(x_BTHD)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor, rope_TH2: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # -1 instead of the head counts: under tensor parallel each rank holds only its share of heads.
        q = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        q, k = apply_rotary(q, rope_TH2), apply_rotary(k, rope_TH2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Grouped-query attention inside the kernel: no copies of k and v repeated per query head.
        out_BHTD = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(out_BHTD.transpose(1, 2).reshape(B, T, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init keeps the residual stream's variance from growing with the layer count.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x_BTD: torch.Tensor, rope_TH2: torch.Tensor) -> torch.Tensor:
        h = x_BTD + self.attention(self.attention_norm(x_BTD), rope_TH2)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    pipeline_first_modules = ("tok_embeddings",)
    pipeline_last_modules = ("norm", "output")
    context_parallel_buffers = ("rope_cache",)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied: the logits use the embedding matrix (Llama 3.2 1B/3B), so there is no separate output layer.
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", rope_cache(args, args.max_seq_len), persistent=False)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = rope_cache(self.args, self.args.max_seq_len)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initializes parameters and the RoPE table in place (after `to_empty` from the meta device)."""
        self.init_buffers(buffer_device)
        if self.tok_embeddings is not None:
            # A tied embedding also makes the logits, so it takes the output layer's scale.
            std = self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers.values():
            if block is not None:
                block.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); stages of a pipeline drop the parts they do not own."""
        h = self.tok_embeddings(tokens_BT) if self.tok_embeddings is not None else tokens_BT
        for block in self.layers.values():
            h = block(h, self.rope_cache)
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        return F.linear(h, self.tok_embeddings.weight) if self.args.tie_embeddings else self.output(h)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding and getattr(model, "tok_embeddings", None) is not None:
        n -= model.tok_embeddings.weight.numel()
    return n


def flops_per_token(model: nn.Module, args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters (the output matmul counted when it is tied to the
    embedding) plus causal-free attention scores (12·L·H·d·T)."""
    output = args.vocab_size * args.dim if args.tie_embeddings else 0
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * (num_params(model, exclude_embedding=True) + output) + attention
