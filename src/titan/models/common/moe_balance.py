"""The balance losses of a mixture of experts, added to the gradient of the model's loss: Qwen3-MoE's Switch
loss (over all layers at once or per layer) from the routing each MoE layer records in a training forward
(MoE.balance_stats).

    out = add_balance_loss(decoder_out, [m for m in model.modules() if isinstance(m, MoE)])
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

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
    loss = load_balancing_loss(torch.stack([p for p, _, _ in stats]), torch.stack([c for _, c, _ in stats]),
                               stats[0][2], first.aux_loss_group, first.args.balance_loss == "per_layer")
    return _AuxLossGrad.apply(out, first.args.aux_loss_coef * first.aux_loss_scale * loss)


def set_aux_loss_scale(parts: list[nn.Module], scale: float, group=None) -> None:
    """Scales every MoE layer's balance loss as the trainer scales each forward batch's loss; `group`: the
    context-parallel ranks, over which each sequence's balance is counted."""
    for moe in (m for part in parts for m in part.modules() if isinstance(m, MoE)):
        moe.aux_loss_scale, moe.aux_loss_group = scale, group
