"""The [model] section: which model, its tokenizer, and overrides of every architecture field of a flavor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan.config.checks import non_negative, positive


@dataclass
class Model:
    name: str = "llama3"
    """Registered model name (llama3, or one registered by model.spec)."""
    flavor: str = "debug"
    """Model size within the family (llama3: debug, debugmodel, 3.2-1B, 3.2-3B, 8B, 70B, 405B, 3.3-70B, or hf =
    the architecture of the Hugging Face folder the run loads or model.hf_assets_path)."""
    spec: str = ""
    """Import path of a module that registers the model, e.g. lcsm.hyena (empty for llama3)."""
    hf_assets_path: str = ""
    """Hugging Face model folder: its tokenizer.json or original/tokenizer.model is the run's tokenizer."""
    tokenizer: Literal["auto", "bpe", "llama3", "hf"] = "auto"
    """llama3 (official 128K), bpe (small BPE trained on the corpus), hf (model.hf_assets_path's); auto = hf when
    hf_assets_path is set, else bpe for the debug flavors and llama3 for the rest."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the corpus-trained BPE tokenizer."""
    n_layers: int = 0
    """Override the flavor's number of layers (0 = keep), e.g. to shorten a big model for a test."""
    dim: int = 0
    """Override the flavor's model width (0 = keep)."""
    n_heads: int = 0
    """Override the flavor's attention heads (0 = keep)."""
    n_kv_heads: int = 0
    """Override the flavor's key/value heads for grouped-query attention (0 = keep)."""
    vocab_size: int = 0
    """Model vocabulary (0 = the tokenizer's, or the Hugging Face folder's); may exceed the tokenizer's."""
    hidden_dim: int = 0
    """Explicit SwiGLU hidden size, HF intermediate_size (0 = the flavor's, or from multiple_of and
    ffn_dim_multiplier)."""
    multiple_of: int = 0
    """Round the derived SwiGLU hidden size up to a multiple of this (0 = keep)."""
    ffn_dim_multiplier: float = 0.0
    """Scale of the derived SwiGLU hidden size (0 = keep)."""
    norm_eps: float = 0.0
    """RMSNorm epsilon (0 = keep)."""
    rope_theta: float = 0.0
    """RoPE base (0 = keep)."""
    rope_scaling: Literal["flavor", "none", "llama3"] = "flavor"
    """RoPE frequency scaling: none, or llama3 (Llama 3.1's long-context rescaling); flavor = keep."""
    rope_factor: float = 0.0
    """llama3 scaling: divisor of the low frequencies (Llama 3.1: 8, 3.2: 32; 0 = keep)."""
    rope_low_freq_factor: float = 0.0
    """llama3 scaling: low frequency factor (0 = keep)."""
    rope_high_freq_factor: float = 0.0
    """llama3 scaling: high frequency factor (0 = keep)."""
    rope_original_max_seq_len: int = 0
    """llama3 scaling: the context length before scaling, HF original_max_position_embeddings (0 = keep)."""
    tie_embeddings: Literal["flavor", "tied", "untied"] = "flavor"
    """Output layer tied to the token embedding (Llama 3.2 1B/3B) or separate; flavor = keep."""

    def __post_init__(self) -> None:
        positive("model", bpe_vocab_size=self.bpe_vocab_size)
        non_negative("model", n_layers=self.n_layers, dim=self.dim, n_heads=self.n_heads,
                     n_kv_heads=self.n_kv_heads, vocab_size=self.vocab_size, hidden_dim=self.hidden_dim,
                     multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier,
                     norm_eps=self.norm_eps, rope_theta=self.rope_theta, rope_factor=self.rope_factor,
                     rope_low_freq_factor=self.rope_low_freq_factor, rope_high_freq_factor=self.rope_high_freq_factor,
                     rope_original_max_seq_len=self.rope_original_max_seq_len)
        if self.bpe_vocab_size < 300:
            raise ValueError(f"model.bpe_vocab_size must be >= 300 (bytes + specials), got {self.bpe_vocab_size}")
        if self.tokenizer == "hf" and not self.hf_assets_path:
            raise ValueError("model.tokenizer 'hf' needs model.hf_assets_path, the folder with tokenizer.json")
