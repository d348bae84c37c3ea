"""Qwen3 (dense)'s architecture fields; the model is the toolkit's `Decoder` with an RMSNorm over each query and
key head, RoPE rotating the two halves of a head, and a head_dim of its own (128, not dim / n_heads)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.models.common.decoder import DecoderArgs


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    """Every architecture field of a Qwen3 Hugging Face config.json has a counterpart here."""

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8
    vocab_size: int = 151936
    hidden_dim: int = 12288
    """SwiGLU hidden size (HF intermediate_size)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_context_len: int = 40960
    head_dim: int = 128
    """Width of each attention head, independent of dim."""

    qk_norm = True
    rope_interleaved = False
