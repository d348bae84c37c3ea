"""Rotary position embeddings: the frequency table (plain, Llama 3.1's long-context rescaling, or YaRN as
DeepSeek-V3 uses it) and the rotation in either pairing of a head's dimensions.

Meta's Llama code rotates interleaved (even, odd) pairs; transformers and Qwen rotate the two halves. Both are the
same function up to a permutation of the query and key rows, so a family picks the pairing its reference uses and
its Hugging Face adapter permutes (or not) accordingly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan.tools.cli import UserError

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
    dtype = torch.promote_types(x_BTHD.dtype, torch.float32)
    x = x_BTHD.to(dtype)
    x = x.reshape(B, T, H, D // 2, 2) if interleaved else x.reshape(B, T, H, 2, D // 2).transpose(-1, -2)
    rope = rope_TH2[:T, None].to(dtype)
    if torch.compiler.is_compiling():  # inductor fuses this arithmetic but generates no code for complex numbers
        cos, sin = rope[..., 0], rope[..., 1]
        rotated = torch.stack((x[..., 0] * cos - x[..., 1] * sin, x[..., 0] * sin + x[..., 1] * cos), dim=-1)
    else:  # one complex multiply, forward and backward: the same products and sums, bit for bit, in fewer kernels
        rotated = torch.view_as_real(torch.view_as_complex(x.contiguous()) * torch.view_as_complex(rope))
    return (rotated if interleaved else rotated.transpose(-1, -2)).flatten(3).type_as(x_BTHD)


@dataclass
class YaRN:
    """YaRN rotary scaling (HF rope_type "yarn"); factor 1 is plain RoPE."""

    theta: float = 10000.0
    factor: float = 1.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    """0 = not given. With both given cos/sin scale by mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    else by mscale(factor, 1); mscale_all_dim alone also sharpens the softmax (transformers' rules)."""

    def __post_init__(self) -> None:
        if self.theta <= 0 or self.factor < 1 or self.original_max_seq_len <= 0 or self.beta_fast <= self.beta_slow:
            raise UserError(f"yarn needs theta > 0, factor >= 1, original_max_seq_len > 0 and beta_fast > "
                            f"beta_slow, got {self.theta}, {self.factor}, {self.original_max_seq_len}, "
                            f"{self.beta_fast}, {self.beta_slow}")


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(rope_dim: int, yarn: YaRN) -> tuple[torch.Tensor, float]:
    """Per-pair frequencies (rope_dim/2,) in fp32 as transformers computes them, and the factor cos/sin are scaled
    by. High frequencies (many turns within the original context) are kept, low ones divided by the factor, the
    band between (beta_fast to beta_slow turns) blended linearly."""
    powers = yarn.theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if yarn.factor == 1:
        return 1.0 / powers, 1.0

    def dim_of(turns: float) -> float:  # the pair index whose wavelength fits `turns` times in the old context
        return rope_dim * math.log(yarn.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(yarn.theta))

    low = max(math.floor(dim_of(yarn.beta_fast)), 0)
    high = min(math.ceil(dim_of(yarn.beta_slow)), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # written as transformers does, so that the table is bit for bit its
    freqs = 1.0 / (yarn.factor * powers) * (1 - keep) + 1.0 / powers * keep
    if yarn.mscale and yarn.mscale_all_dim:
        return freqs, yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return freqs, yarn_mscale(yarn.factor, 1.0)


def yarn_rope_cache(rope_dim: int, yarn: YaRN, seq_len: int) -> torch.Tensor:
    """(seq_len, rope_dim/2, 2) cos/sin table, the format apply_rotary reads."""
    freqs, scale = yarn_frequencies(rope_dim, yarn)
    angles_TH = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles_TH.cos(), angles_TH.sin()), dim=-1) * scale
