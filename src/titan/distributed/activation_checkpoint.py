"""Activation checkpointing of the blocks in `model.layers`: full, every N-th block, or per op."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan.tools.logging import logger

# Saving matmul outputs keeps the expensive recomputation away; everything else (norms, activations,
# elementwise ops) is cheap to redo. Every second mm is still recomputed to bound memory, as TorchTitan does.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.max.default,
    # Recomputing a collective would repeat communication, not just arithmetic: TP's reduce-scatter, and expert
    # parallel's all-to-alls (the counts, the tokens' dispatch and combine; titan.distributed.expert_parallel).
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}


def _op_policy_contexts():
    """The contexts of one checkpointed call: its own matmul count, so every block saves the same matmuls. torch
    calls the policy in the forward only; the recompute replays its decisions."""
    mm_count = 0

    def policy(ctx, func, *args, **kwargs):
        nonlocal mm_count
        if func == torch.ops.aten.mm.default:
            mm_count += 1
            if mm_count % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, ac_config) -> None:
    """Wraps blocks of `model.layers` in place according to `activation_checkpoint.mode`."""
    if ac_config.mode == "none":
        return
    option = ac_config.selective_ac_option
    wrapped = 0
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if ac_config.mode == "full" or (ac_config.mode == "selective" and option != "op" and i % int(option) == 0):
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        elif ac_config.mode == "selective" and option == "op":
            block = checkpoint_wrapper(block, context_fn=_op_policy_contexts, preserve_rng_state=False)
        else:
            continue
        model.layers.register_module(name, block)
        wrapped += 1
    detail = f"selective {option}" if ac_config.mode == "selective" else "full"
    logger.info(f"applied {detail} activation checkpointing to {wrapped} blocks")
