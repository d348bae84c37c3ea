"""torch.compile per block (blocks are identical, so one compiled graph serves them all) and of the loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titan.tools.logging import logger


def apply_compile(model: nn.Module, compile_config) -> None:
    """Compiles each block of `model.layers` in place, as one graph (fullgraph, which also traces host values such
    as a MoE's tokens per expert, the split sizes where no grouped GEMM runs, as unbacked sizes)."""
    if not (compile_config.enable and "model" in compile_config.components):
        return
    for name, block in list(model.layers.named_children()):
        compiled = torch.compile(block, backend=compile_config.backend, fullgraph=True)
        _trace_with_block_config(compiled)
        model.layers.register_module(name, compiled)
    logger.info(f"compiled {len(model.layers)} blocks with torch.compile({compile_config.backend})")


def _trace_with_block_config(block: nn.Module) -> None:
    """Dynamo reads its config when it traces, inside the block's call: the blocks' flag is set around each call
    only, so other compiles in the process (the loss, a user's) keep dynamo's defaults. The flag: a MoE records its
    routing for the balance loss (MoE.balance_stats) once a forward, as eager skips it in an activation checkpoint's
    recompute; dynamo refuses that side effect inside a checkpoint unless told so."""
    patches = []

    def enter(module, args) -> None:
        patches.append(torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True))
        patches[-1].__enter__()

    def leave(module, args, output) -> None:
        patches.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)


def compile_loss(loss_fn: Callable, compile_config) -> Callable:
    """The loss function, compiled when compile.components names it."""
    if not (compile_config.enable and "loss" in compile_config.components):
        return loss_fn
    logger.info(f"compiled the loss with torch.compile({compile_config.backend})")
    return torch.compile(loss_fn, backend=compile_config.backend)
