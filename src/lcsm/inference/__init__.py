"""Exact autoregressive inference for long convolutions: engines, tiles, tau kernels, decode, generate, bench."""
