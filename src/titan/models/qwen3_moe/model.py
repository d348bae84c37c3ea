"""Qwen3-MoE's architecture fields and model: Qwen3 (QK-norm, half-split RoPE, head_dim of its own) whose
feed-forward is a mixture of experts (softmax top-k routing, no shared experts) in every `decoder_sparse_step`-th
block but the `mlp_only_layers`, which keep a dense SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titan.models.common.moe import MoE, MoEArgs
from titan.models.common.moe_balance import MoEDecoder
from titan.models.qwen3.model import Qwen3ModelArgs
from titan.tools.cli import UserError


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    """Every architecture field of a Qwen3-MoE Hugging Face config.json has a counterpart here."""

    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int | None = 4
    hidden_dim: int = 6144
    """Dense SwiGLU hidden size of the mlp_only_layers (HF intermediate_size)."""
    max_context_len: int = 40960
    moe_hidden_dim: int = 768
    """Each expert's SwiGLU hidden size (HF moe_intermediate_size)."""
    num_experts: int = 128
    top_k: int = 8
    route_norm: bool = True
    """Renormalise the k chosen probabilities (HF norm_topk_prob)."""
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    aux_loss_coef: float = 0.001
    """Load-balancing loss weight in training (HF router_aux_loss_coef); the loss is per forward shard of tokens
    (each micro-batch of a data-parallel rank's batch, each tensor-parallel rank's sequence shard), averaged over
    the shards; under pipeline parallel over each stage's layers (MoEArgs.aux_loss_coef)."""
    balance_loss: Literal["all_layers", "per_layer"] = "all_layers"
    """all_layers: transformers' loss over all MoE layers' routing at once (taken per stage under pipeline
    parallel); per_layer: each layer's own Switch loss, summed over the layers, as TorchTitan (MoEArgs.balance_loss).
    Training only: no Hugging Face field."""
    use_grouped_mm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoder_sparse_step < 1:
            raise UserError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        _ = self.moe_args  # its own checks

    @property
    def moe_args(self) -> MoEArgs:
        return MoEArgs(num_experts=self.num_experts, top_k=self.top_k, hidden_dim=self.moe_hidden_dim,
                       route_norm=self.route_norm, aux_loss_coef=self.aux_loss_coef,
                       balance_loss=self.balance_loss, use_grouped_mm=self.use_grouped_mm)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


class Qwen3MoeDecoder(MoEDecoder):
    """The toolkit's Decoder with a MoE as the feed-forward of its sparse blocks."""

    def __init__(self, args: Qwen3MoeModelArgs):
        super().__init__(args)
        for i, block in self.layers.items():
            if args.is_moe_layer(int(i)):
                block.feed_forward = MoE(args.dim, args.moe_args)


def active_params(model: Qwen3MoeDecoder) -> int:
    """Parameters one token uses: all but the routed experts it does not reach (k of E per MoE layer)."""
    args = model.args
    routed = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())
    return sum(p.numel() for p in model.parameters()) - routed // args.num_experts * (args.num_experts - args.top_k)


def flops_per_token(model: Qwen3MoeDecoder, args: Qwen3MoeModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the non-embedding parameters a token uses plus causal-free attention scores
    (12·L·H·d·T)."""
    embedding = args.vocab_size * args.dim if model.tok_embeddings is not None else 0
    output = embedding if args.tie_embeddings else 0
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * (active_params(model) - embedding + output) + attention
