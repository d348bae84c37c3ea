"""The pieces a training run is built from: optimizer and lr schedule, checkpointing, metrics, data."""
