from titan.components.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    complete_steps,
    full_model_state_dict,
    load_full_model_state_dict,
)

__all__ = ["CheckpointError", "CheckpointManager", "complete_steps", "full_model_state_dict",
           "load_full_model_state_dict"]
