"""DeepSeek-V3 as plain single-device PyTorch: MLA attention with YaRN, the first n_dense_layers blocks with a
dense SwiGLU and the rest with a mixture of experts (sigmoid routing with a selection bias, group-limited, shared
experts, and optionally the report's complementary sequence-wise balance loss), RMSNorm, untied output.
Multi-token prediction is not built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from titan.models.common.decoder import FeedForward
from titan.models.common.mla import MLA, MLAArgs
from titan.models.common.moe import MoE, MoEArgs
from titan.models.common.moe_balance import MoEDecoder
from titan.models.common.rope import YaRN, yarn_rope_cache
from titan.tools.cli import UserError


@dataclass
class ModelArgs:
    """Flat, with TorchTitan's DeepSeek-V3 names; every architecture field of a transformers DeepseekV3Config has a
    counterpart (hf_adapter maps them)."""

    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1
    """The first blocks use a dense SwiGLU (HF first_k_dense_replace)."""
    n_heads: int = 16
    vocab_size: int = 102400
    inter_dim: int = 10944
    """Dense SwiGLU hidden size (HF intermediate_size)."""
    moe_inter_dim: int = 1408
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    bias_update_rate: float = 1e-3
    """Auxiliary-loss-free balancing: how far each step moves the experts' selection biases (0 = fixed)."""
    seq_aux_loss_alpha: float = 0.0
    """The complementary sequence-wise balance loss's weight alpha (the report's 0.0001; 0 = off): in training the
    model adds alpha x each MoE layer's loss, averaged over the sequences and summed over the layers, to the
    gradient (moe_balance.sequence_balance_loss). Training only: no Hugging Face field."""
    use_grouped_mm: bool = True
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    max_context_len: int = 163840
    """Context the weights are made for (HF max_position_embeddings); exported, not used by training."""
    max_seq_len: int = 4096
    """Length of the RoPE table built (the training sequence length)."""
    rope_interleave: bool = True
    """How a Hugging Face folder lays out the rotary rows (HF rope_interleave); titan's are always interleaved,
    so this only says whether an import permutes them."""

    tie_embeddings: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "inter_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise UserError(f"n_dense_layers must be in [0, n_layers = {self.n_layers}], got "
                            f"{self.n_dense_layers}")
        if not 0 <= self.seq_aux_loss_alpha < float("inf"):
            raise UserError(f"seq_aux_loss_alpha must be a finite number >= 0 (the report used 0.0001), got "
                            f"{self.seq_aux_loss_alpha}")
        _ = self.mla_args, self.moe_args, self.yarn  # their own checks

    @property
    def rope_scaling(self) -> str:
        return "yarn" if self.rope_factor != 1 else "none"

    @property
    def mla_args(self) -> MLAArgs:
        return MLAArgs(n_heads=self.n_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                       qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim, norm_eps=self.norm_eps)

    @property
    def moe_args(self) -> MoEArgs:
        return MoEArgs(num_experts=self.n_routed_experts, top_k=self.n_activated_experts,
                       hidden_dim=self.moe_inter_dim, num_shared_experts=self.n_shared_experts,
                       score_func=self.score_func, route_norm=self.route_norm, route_scale=self.route_scale,
                       n_groups=self.n_expert_groups, topk_groups=self.n_limited_groups,
                       bias_update_rate=self.bias_update_rate, aux_loss_coef=self.seq_aux_loss_alpha,
                       balance_loss="per_sequence", use_grouped_mm=self.use_grouped_mm)

    @property
    def yarn(self) -> YaRN:
        return YaRN(theta=self.rope_theta, factor=self.rope_factor, original_max_seq_len=self.rope_original_max_seq_len,
                    beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow, mscale=self.rope_mscale,
                    mscale_all_dim=self.rope_mscale_all_dim)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = MLA(args.dim, args.mla_args, args.yarn)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        dense = layer_id < args.n_dense_layers
        self.feed_forward = FeedForward(args.dim, args.inter_dim) if dense else None
        self.moe = None if dense else MoE(args.dim, args.moe_args)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x_BTD: torch.Tensor, rope_TH2: torch.Tensor) -> torch.Tensor:
        h = x_BTD + self.attention(self.attention_norm(x_BTD), rope_TH2)
        ffn = self.feed_forward if self.moe is None else self.moe
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        (self.feed_forward if self.moe is None else self.moe).init_weights(self.init_std)


class Transformer(MoEDecoder):
    """The toolkit's Decoder (its forward, init and pipeline/context-parallel hooks) over DeepSeek-V3 blocks and a
    YaRN table of the rotary head dims."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not Decoder's: its blocks are GQA ones
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self) -> torch.Tensor:
        return yarn_rope_cache(self.args.qk_rope_head_dim, self.args.yarn, self.args.max_seq_len)



def flops_per_token(model: Transformer, args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the non-embedding parameters a token uses (k of the E routed experts) plus
    causal-free attention scores (6·L·H·(qk + v head dims)·T)."""
    active = active_params(model) - (args.vocab_size * args.dim if model.tok_embeddings is not None else 0)
    attention = 6 * args.n_layers * args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    return 6 * active + attention * seq_len


def active_params(model: Transformer) -> int:
    """Parameters one token uses: all but the routed experts it does not reach (k of E per MoE layer)."""
    args = model.args
    routed = sum(p.numel() for block in model.layers.values() if block.moe is not None
                 for p in block.moe.experts.parameters())
    unused = routed // args.n_routed_experts * (args.n_routed_experts - args.n_activated_experts)
    return sum(p.numel() for p in model.parameters()) - unused
