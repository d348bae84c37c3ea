"""A pre-norm decoder-only transformer as plain single-device PyTorch, shared by the LLM families: grouped-query
attention through SDPA (head_dim independent of dim, optional RMSNorm of each query and key head), RoPE, SwiGLU,
RMSNorm, optionally tied input and output embeddings.

A family subclasses `DecoderArgs` (its fields are the family's `--model.*` keys) and builds a `Decoder` from it;
module names are the same in every family, so that parallelize plans, the pipeline split and the estimator work
on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.rope import apply_rotary, rope_cache
from titan.tools.cli import UserError


@dataclass
class DecoderArgs:
    """The architecture fields every decoder family shares; a family adds its own and sets the class constants."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    hidden_dim: int = 0
    """SwiGLU hidden size (HF intermediate_size)."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Literal["none", "llama3"] = "none"
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

    qk_norm: ClassVar[bool] = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    rope_interleaved: ClassVar[bool] = False
    """RoPE pairs: interleaved (Meta's Llama code) or the two halves of a head (transformers, Qwen)."""

    def __post_init__(self) -> None:
        kv = self.n_kv_heads or self.n_heads
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "max_context_len"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % kv:
            raise UserError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {kv}; pick a divisor")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise UserError(f"head dim {self.head_dim} must be even and > 0 for RoPE")
        if self.ffn_hidden_dim <= 0:
            raise UserError(f"hidden_dim (the SwiGLU width) must be > 0, got {self.ffn_hidden_dim}")
        if self.hidden_dim < 0 or self.norm_eps <= 0 or self.rope_theta <= 0:
            raise UserError(f"hidden_dim must be >= 0 and norm_eps, rope_theta > 0, got "
                             f"{self.hidden_dim}, {self.norm_eps}, {self.rope_theta}")
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
        return self.hidden_dim


# Narrower heads than this run a CPU's SDPA in fp32 when the inputs are bf16 or fp16.
CPU_FP32_ATTENTION_BELOW_HEAD_DIM = 64


def causal_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Causal SDPA (scale 1/sqrt(head dim) unless given), grouped-query when k and v have fewer heads than q; in q's
    dtype.

    On a CPU, bf16/fp16 heads narrower than 64 run in fp32: there PyTorch's CPU flash kernel is slower in bf16 than
    in fp32 (forward + backward at head dim 16 about 2x, at 32 1.1-1.3x, even at 64; benchmarks/RESULTS.md)."""
    # Grouped-query attention inside the kernel: no copies of k and v repeated per query head.
    gqa = q_BHTD.shape[1] != k_BHTD.shape[1]
    if (q_BHTD.device.type == "cpu" and q_BHTD.dtype in (torch.bfloat16, torch.float16)
            and q_BHTD.shape[-1] < CPU_FP32_ATTENTION_BELOW_HEAD_DIM):
        with torch.autocast("cpu", enabled=False):  # CPU autocast would cast the fp32 inputs back down
            out = F.scaled_dot_product_attention(q_BHTD.float(), k_BHTD.float(), v_BHTD.float(), is_causal=True,
                                                 scale=scale, enable_gqa=gqa)
        return out.to(q_BHTD.dtype)
    return F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, is_causal=True, scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.interleaved = args.rope_interleaved
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x_BTD: torch.Tensor, rope_TH2: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # -1 instead of the head counts: under tensor parallel each rank holds only its share of heads.
        q = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope_TH2, self.interleaved), apply_rotary(k, rope_TH2, self.interleaved)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out_BHTD = causal_attention(q, k, v)
        return self.wo(out_BHTD.transpose(1, 2).reshape(B, T, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

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
    def __init__(self, layer_id: int, args: DecoderArgs):
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


class Decoder(nn.Module):
    """Token ids -> logits; `args` (a DecoderArgs) says which family it is."""

    pipeline_first_modules = ("tok_embeddings",)
    pipeline_last_modules = ("norm", "output")
    context_parallel_buffers = ("rope_cache",)

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied: the logits use the embedding matrix, so there is no separate output layer.
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self) -> torch.Tensor:
        """The RoPE table of the training sequence length (a family with other rotary dims overrides it)."""
        return rope_cache(self.args, self.args.max_seq_len)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self._rope_cache()

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


def flops_per_token(model: nn.Module, args: DecoderArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters (the output matmul counted when it is tied to the
    embedding) plus causal-free attention scores (12·L·H·d·T)."""
    output = args.vocab_size * args.dim if args.tie_embeddings else 0
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * (num_params(model, exclude_embedding=True) + output) + attention
