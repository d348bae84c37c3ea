"""The balance losses of a mixture of experts, added to the gradient of the model's loss: Qwen3-MoE's Switch
loss (over all layers at once or per layer) and DeepSeek-V3's sequence-wise loss, from the routing each MoE layer
records in a training forward (MoE.balance_stats); MoEDecoder, the families' base, adds them in its forward.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from titan.models.common.decoder import Decoder
from titan.models.common.moe import MoE


class _AuxLossGrad(torch.autograd.Function):
    """Returns x unchanged; in backward the auxiliary loss gets gradient 1, as if it were added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


def load_balancing_loss(prob_sums_LE: torch.Tensor, counts_LE: torch.Tensor, tokens: int, group=None,
                        per_layer: bool = False) -> torch.Tensor:
    """Switch Transformer's balance loss E * sum_e f_e * P_e, with f_e expert e's routed copies over the token rows
    and P_e its mean router probability over them. By default as transformers' Qwen3-MoE computes it, over all L
    layers' routing at once (L*T rows); `per_layer`: each layer's own loss over its T rows, summed over the layers.
    prob_sums_LE: each layer's probabilities summed over its T tokens.

    `group`: the ranks holding the rest of these sequences (context parallel). f_e is then that of all their
    tokens, and P_e this rank's part of their mean times the group size, since data parallel averages the ranks'
    gradients: the average is the gradient of the whole sequences' loss."""
    counts_LE = counts_LE.to(prob_sums_LE.dtype)
    if not per_layer:  # one "layer" of L*T rows
        tokens *= len(counts_LE)
        prob_sums_LE, counts_LE = prob_sums_LE.sum(dim=0, keepdim=True), counts_LE.sum(dim=0, keepdim=True)
    if group is not None:
        counts_LE = funcol.all_reduce(counts_LE, "sum", group) / torch.distributed.get_world_size(group)
    return prob_sums_LE.shape[-1] * (counts_LE / tokens * prob_sums_LE / tokens).sum()


def sequence_balance_loss(prob_sums_LBE: torch.Tensor, counts_LBE: torch.Tensor, tokens: int, top_k: int,
                          group=None) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (technical report, section 2.1.2, eqs. 17-20), without
    its alpha: for each layer and each sequence of T tokens, sum_i f_i P_i with f_i = E / (K T) x the sequence's
    tokens whose top K hold expert i, and P_i the sequence's mean of s_it / sum_j s_jt over all E experts (s the
    router's scores); averaged over the B sequences and summed over the L layers.

    The mean over sequences makes the loss that of a sequence whatever the batch, so that, like the mean
    cross-entropy, the scaled sums over micro-batches, accumulation steps and data-parallel ranks give the
    one-process value exactly; the sum over layers balances each layer on its own with the report's per-layer alpha
    (as TorchTitan and Megatron-LM sum their per-layer losses), and makes a pipeline stage's share that of its own
    layers. prob_sums_LBE and counts_LBE: each sequence's normalized scores summed over this rank's `tokens` of it,
    and how many of them chose each expert (moe.sequence_stats).

    `group`: the ranks holding the rest of each sequence (context parallel, and tensor parallel, whose ranks route
    their own sequence shards). f_i counts the sequence's tokens on all of them, and P_i is this rank's part of the
    sequence's mean times the group size: the ranks' gradients are averaged, which gives the whole sequence's."""
    size = 1 if group is None else torch.distributed.get_world_size(group)
    if group is not None:
        counts_LBE = funcol.all_reduce(counts_LBE, "sum", group)
    f_LBE = counts_LBE * (prob_sums_LBE.shape[-1] / (top_k * tokens * size))
    return (f_LBE * prob_sums_LBE / tokens).sum(dim=-1).mean(dim=-1).sum()


def add_balance_loss(out: torch.Tensor, layers: list[MoE]) -> torch.Tensor:
    """`out` unchanged, with coef * the balance loss (MoEArgs.balance_loss) over the routing `layers` recorded in
    this forward added to the loss's gradient (MoEArgs.aux_loss_coef, times the trainer's scale); the records are
    consumed."""
    stats = [m.balance_stats for m in layers if m.balance_stats is not None]
    for moe in layers:
        moe.balance_stats = None
    if not stats:
        return out
    first = layers[0]
    prob_sums, counts = torch.stack([p for p, _, _ in stats]), torch.stack([c for _, c, _ in stats])
    if first.args.balance_loss == "per_sequence":
        loss = sequence_balance_loss(prob_sums, counts, stats[0][2], first.args.top_k, first.aux_loss_group)
    else:
        loss = load_balancing_loss(prob_sums, counts, stats[0][2], first.aux_loss_group,
                                   first.args.balance_loss == "per_layer")
    return _AuxLossGrad.apply(out, first.args.aux_loss_coef * first.aux_loss_scale * loss)


def set_aux_loss_scale(parts: list[nn.Module], scale: float, cp_group=None, cp_tp_group=None) -> None:
    """Scales every MoE layer's balance loss as the trainer scales each forward batch's loss, and gives it the ranks
    over which each sequence's balance is counted: the context-parallel ranks, and for the sequence-wise loss the
    tensor-parallel ranks too (`cp_tp_group`); the Switch losses take a TP rank's sequence shard as a batch of its
    own (MoEArgs.aux_loss_coef)."""
    for moe in (m for part in parts for m in part.modules() if isinstance(m, MoE)):
        moe.aux_loss_scale = scale
        moe.aux_loss_group = cp_tp_group if moe.args.balance_loss == "per_sequence" else cp_group


class MoEDecoder(Decoder):
    """A Decoder with mixture-of-experts layers: their buffers are initialized with the model's, and in training its
    forward adds their balance loss (MoEArgs.aux_loss_coef; a pipeline stage's own layers) to the gradient."""

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        super().init_buffers(buffer_device)
        for moe in self.moe_layers():
            moe.init_buffers()

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        return add_balance_loss(super().forward(tokens_BT), self.moe_layers())
