"""Context parallel: the sequence is sharded over the cp mesh and attention runs as ring attention.

PyTorch's CP dispatcher routes the CUDA SDPA kernels (flash, efficient, cuDNN) through its ring-attention
templates, but not the CPU flash kernel, so `context_parallel()` fails on a CPU. This module gives the CPU
kernel the same treatment: a sharding rule (everything sharded on the sequence dim) and a handler that runs
the ring templates with the CPU forward/backward ops. The templates do the head-tail load balancing and the
log-sum-exp merging, so the result is exact.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder, register_single_dim_strategy
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention

from titan.protocols.model import ContextParallelModel

aten = torch.ops.aten
SEQ_DIM = 2  # q, k, v are (batch, heads, seq, head_dim) inside SDPA
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _all_on_sequence(count: int):
    def strategy(op, args_schema, kwargs_schema):
        return [[_ShardingPlaceholder(SEQ_DIM)] * count]

    return strategy


def _ring_forward(mesh: DeviceMesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                  scale=None):
    if attn_mask is not None:
        raise ValueError("context parallel attention supports causal masking only, not an explicit attn_mask")
    return _attention._templated_ring_attention(mesh.get_group(), SEQ_DIM, CPU_FLASH, query=query, key=key,
                                                value=value, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh: DeviceMesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                   attn_mask=None, scale=None):
    return _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, CPU_FLASH_BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query,
        key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
    )


def _cpu_sdpa_handler(op_call, args, kwargs):
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    ring = _ring_forward if op_call == CPU_FLASH else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return DTensor._op_dispatcher.wrap(tuple(local), output_sharding.output_spec)


def _register_cpu_kernels() -> None:
    # Outputs first, then tensor inputs: (out, lse | q, k, v) and (dq, dk, dv | dout, q, k, v, out, lse).
    register_single_dim_strategy(CPU_FLASH, schema_info=RuntimeSchemaInfo(3))(_all_on_sequence(5))
    register_single_dim_strategy(CPU_FLASH_BACKWARD)(_all_on_sequence(9))
    _attention.custom_ops[CPU_FLASH] = _cpu_sdpa_handler
    _attention.custom_ops[CPU_FLASH_BACKWARD] = _cpu_sdpa_handler


_register_cpu_kernels()


@contextmanager
def sequence_sharded(cp_mesh: DeviceMesh, model_parts: list[nn.Module], inputs: torch.Tensor,
                     labels: torch.Tensor):
    """Shards inputs, labels (dim 1) and the models' positional buffers (dim 0) for the enclosed step.

    A model names its sequence-indexed buffers as a `ContextParallelModel`; their length must equal the
    training sequence length.
    """
    buffers, dims = [inputs, labels], [1, 1]
    for part in model_parts:
        for name in part.context_parallel_buffers if isinstance(part, ContextParallelModel) else ():
            buffers.append(getattr(part, name))
            dims.append(0)
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={inputs, labels}):
        yield
