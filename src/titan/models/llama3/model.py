"""Llama 3.x's architecture fields; the model is the toolkit's `Decoder` (RMSNorm, RoPE in Meta's interleaved
pairing, optionally with Llama 3.1's frequency scaling, GQA, SwiGLU, optionally tied embeddings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan.models.common.decoder import Decoder, DecoderArgs
from titan.tools.cli import UserError


@dataclass
class ModelArgs(DecoderArgs):
    """Every architecture field of a Llama 3.x Hugging Face config.json has a counterpart here."""

    hidden_dim: int = 0
    """Explicit SwiGLU hidden size (HF intermediate_size); 0 = derived from multiple_of and ffn_dim_multiplier."""
    rope_scaling: Literal["none", "llama3"] = "llama3"
    multiple_of: int = 256
    """Round the derived SwiGLU hidden size up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scale of the derived SwiGLU hidden size."""

    rope_interleaved = True

    def __post_init__(self) -> None:
        if self.multiple_of <= 0:
            raise UserError(f"multiple_of must be > 0, got {self.multiple_of}")
        if self.n_heads > 0 and self.dim % self.n_heads:
            raise UserError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        super().__post_init__()

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim:
            return self.hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


Transformer = Decoder
