from titan.distributed.activation_checkpoint import apply_ac
from titan.distributed.compile import apply_compile, compile_loss
from titan.distributed.data_parallel import apply_data_parallel, apply_fsdp
from titan.distributed.parallel_dims import ParallelDims

__all__ = [
    "ParallelDims", "apply_ac", "apply_compile", "apply_data_parallel", "apply_fsdp", "compile_loss",
]
