"""Rotary position embeddings: the frequency table (plain, or Llama 3.1's long-context rescaling) and the rotation
in either pairing of a head's dimensions.

Meta's Llama code rotates interleaved (even, odd) pairs; transformers and Qwen rotate the two halves. Both are the
same function up to a permutation of the query and key rows, so a family picks the pairing its reference uses and
its Hugging Face adapter permutes (or not) accordingly.
"""

from __future__ import annotations

import math

import torch

ROPE_SCALINGS = ("none", "llama3")


def rope_frequencies(args) -> torch.Tensor:
    """Per-pair rotation frequencies (head_dim/2,) in fp32, as Meta's reference and transformers compute them.

    `args` gives head_dim, rope_theta, rope_scaling and, for llama3 scaling, rope_factor, rope_low_freq_factor,
    rope_high_freq_factor and rope_original_max_seq_len."""
    head_dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if args.rope_scaling == "none":
        return freqs
    factor, low, high = args.rope_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_context = args.rope_original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / freqs
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context / wavelen - low) / (high - low)
    mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_cache(args, seq_len: int) -> torch.Tensor:
    """(seq_len, head_dim/2, 2) cos/sin table; a real buffer so it can be sharded for context parallel."""
    angles_TH = torch.outer(torch.arange(seq_len, dtype=torch.float32), rope_frequencies(args))
    return torch.stack((angles_TH.cos(), angles_TH.sin()), dim=-1)


def apply_rotary(x_BTHD: torch.Tensor, rope_TH2: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotates pair i of each head by angle i: pairs (2i, 2i+1) when `interleaved`, else (i, i + head_dim/2)."""
    B, T, H, D = x_BTHD.shape
    # At least fp32 (fp64 stays fp64, so that fp64 runs compare exactly with other implementations).
    x = x_BTHD.to(torch.promote_types(x_BTHD.dtype, torch.float32))
    x = x.reshape(B, T, H, D // 2, 2) if interleaved else x.reshape(B, T, H, 2, D // 2).transpose(-1, -2)
    cos = rope_TH2[:T, None, :, 0]
    sin = rope_TH2[:T, None, :, 1]
    real = x[..., 0] * cos - x[..., 1] * sin
    imag = x[..., 0] * sin + x[..., 1] * cos
    out = torch.stack((real, imag), dim=-1) if interleaved else torch.stack((real, imag), dim=-2)
    return out.flatten(3).type_as(x_BTHD)
