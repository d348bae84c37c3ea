"""torch.compile per block (blocks are identical, so one compiled graph serves them all) and of the loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titan.tools.logging import logger


def apply_compile(model: nn.Module, compile_config) -> None:
    if not (compile_config.enable and "model" in compile_config.components):
        return
    # Host values inside a block (a MoE's tokens per expert, which split its sorted tokens where no grouped GEMM
    # runs) are traced as unbacked sizes, not graph breaks, which fullgraph would refuse.
    torch._dynamo.config.capture_scalar_outputs = True
    # A MoE records its routing for the balance loss (MoE.balance_stats) once a forward, as eager skips it in an
    # activation checkpoint's recompute; dynamo refuses that side effect inside a checkpoint unless told so.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend=compile_config.backend, fullgraph=True))
    logger.info(f"compiled {len(model.layers)} blocks with torch.compile({compile_config.backend})")


def compile_loss(loss_fn: Callable, compile_config) -> Callable:
    """The loss function, compiled when compile.components names it."""
    if not (compile_config.enable and "loss" in compile_config.components):
        return loss_fn
    logger.info(f"compiled the loss with torch.compile({compile_config.backend})")
    return torch.compile(loss_fn, backend=compile_config.backend)
