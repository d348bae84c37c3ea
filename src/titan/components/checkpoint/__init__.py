from titan.components.checkpoint.manager import (
    CheckpointManager,
    complete_steps,
    full_model_state_dict,
    load_full_model_state_dict,
)
from titan.components.checkpoint.reader import CheckpointError, DamagedCheckpoint, UnsafeCheckpoint, read_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "DamagedCheckpoint", "complete_steps", "full_model_state_dict",
           "load_full_model_state_dict", "read_checkpoint", "UnsafeCheckpoint"]
