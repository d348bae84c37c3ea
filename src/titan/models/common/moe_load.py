"""Expert load between optimizer steps: every MoE layer's routed-token counts summed over the ranks, DeepSeek-V3's
selection-bias update and the load metrics."""

from __future__ import annotations

import torch
from torch import nn

from titan.models.common.moe import MoE

LOAD_METRICS = ("moe_tokens_min", "moe_tokens_max", "moe_imbalance", "moe_imbalance_all_layers")


@torch.no_grad()
def expert_load_step(model: nn.Module | list[nn.Module], group=None, pp_group=None,
                     num_experts: int = 0) -> dict[str, torch.Tensor]:
    """After an optimizer step: sums every MoE layer's routed-token counts over `group` (the ranks that see other
    tokens: data and context parallel, and tensor parallel, whose ranks route their own sequence shards), moves
    DeepSeek-V3's selection biases towards balance, resets the counts, and returns the load seen as 0-d tensors on
    the device, read by the host only when it logs: tokens per expert, min and max over layers and experts;
    imbalance = max / mean of the worst layer; imbalance_all_layers = max / mean of the experts' counts summed over
    the layers (what the all-layer balance loss balances). `model`: a model or a rank's pipeline stages; `pp_group`:
    the pipeline ranks, whose stages hold the other layers (the model has experts, so every stage takes part, one
    without MoE layers too, which needs `num_experts`, that of every MoE layer). Nothing when there is no MoE layer
    and no pipeline."""
    parts = model if isinstance(model, list) else [model]
    layers = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
    if not layers and pp_group is None:
        return {}
    if layers:
        counts_LE = torch.stack([m.tokens_per_expert for m in layers])
        if group is not None:
            torch.distributed.all_reduce(counts_LE, group=group)
        for moe, counts_E in zip(layers, counts_LE):
            if moe.args.bias_update_rate:
                bias = moe.router.expert_bias
                bias += moe.args.bias_update_rate * torch.sign(counts_E.mean() - counts_E).to(bias.dtype)
            moe.tokens_per_expert.zero_()
        mean_L = counts_LE.mean(dim=1).clamp(min=1)
        # -min, so that the stages' three values combine by a max.
        stats = torch.stack([-counts_LE.min(), counts_LE.max(), (counts_LE.max(dim=1).values / mean_L).max()])
        counts_E = counts_LE.sum(dim=0)
    else:  # a stage of dense blocks: the identity of each max, and no tokens
        device = next(b.device for part in parts for b in (*part.parameters(), *part.buffers()))
        stats = torch.tensor([-torch.inf, 0.0, 0.0], device=device)
        counts_E = torch.zeros(num_experts, device=device)
    values = torch.cat([stats.double(), counts_E.double()])
    if pp_group is not None:  # one gather: the stages' stats combine by a max, their counts by a sum
        gathered = [torch.empty_like(values) for _ in range(torch.distributed.get_world_size(pp_group))]
        torch.distributed.all_gather(gathered, values, group=pp_group)
        stages_SV = torch.stack(gathered)
        values = torch.cat([stages_SV[:, :3].max(dim=0).values, stages_SV[:, 3:].sum(dim=0)])
    stats, counts_E = values[:3], values[3:]
    return dict(zip(LOAD_METRICS, (-stats[0], stats[1], stats[2], counts_E.max() / counts_E.mean().clamp(min=1))))


def expert_load_values(parts: list[nn.Module], group=None, pp_group=None,
                       num_experts: int = 0) -> tuple[list[str], torch.Tensor]:
    """expert_load_step over a rank's model parts: the metric names and their values as one float64 device tensor
    (empty without MoE layers)."""
    stats = expert_load_step(parts, group, pp_group, num_experts)
    values = torch.stack(list(stats.values())).double() if stats else torch.zeros(0, dtype=torch.float64)
    return list(stats), values

