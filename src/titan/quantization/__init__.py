"""Low-precision training."""
