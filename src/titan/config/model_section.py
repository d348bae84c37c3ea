"""The [model] section: what every model shares (which model, its tokenizer), plus the architecture fields of the
model's own family, which that family owns and checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from titan.config.checks import positive


@dataclass
class Model:
    OPEN_KEYS: ClassVar[str] = "args"
    """The field that collects every other `--model.<key>`: keys of the family's args dataclass."""

    name: str = "llama3"
    """Registered model name (llama3, qwen3, or one registered by model.spec)."""
    flavor: str = "debug"
    """Model size within the family (llama3: debug, debugmodel, 3.2-1B, 3.2-3B, 8B, 70B, 405B, 3.3-70B; qwen3:
    debug, 0.6B, 1.7B, 4B, 8B, 14B, 32B; or hf = the architecture of the Hugging Face folder the run loads or
    model.hf_assets_path)."""
    spec: str = ""
    """Import path of a module that registers the model, e.g. lcsm.hyena (empty for the built-in families)."""
    hf_assets_path: str = ""
    """Hugging Face model folder: its tokenizer.json or original/tokenizer.model is the run's tokenizer."""
    tokenizer: Literal["auto", "bpe", "llama3", "hf"] = "auto"
    """llama3 (official 128K), bpe (small BPE trained on the corpus), hf (model.hf_assets_path's); auto = hf when
    hf_assets_path is set, else bpe for the debug flavors and llama3 for the rest."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the corpus-trained BPE tokenizer."""
    args: dict[str, Any] = field(default_factory=dict)
    """Overrides of the flavor's architecture: any field of the family's args dataclass, set as `--model.<field>`
    or as a key of [model] (e.g. llama3/qwen3: n_layers, dim, n_heads, n_kv_heads, vocab_size, hidden_dim,
    norm_eps, rope_theta, tie_embeddings, ...; qwen3 also head_dim). The family checks the keys and their types."""

    def __post_init__(self) -> None:
        positive("model", bpe_vocab_size=self.bpe_vocab_size)
        if self.bpe_vocab_size < 300:
            raise ValueError(f"model.bpe_vocab_size must be >= 300 (bytes + specials), got {self.bpe_vocab_size}")
        if self.tokenizer == "hf" and not self.hf_assets_path:
            raise ValueError("model.tokenizer 'hf' needs model.hf_assets_path, the folder with tokenizer.json")
        if self.args:
            from titan.models import model_arg_overrides  # the family's module, imported only when keys are set

            self.args = model_arg_overrides(self.name, self.spec, self.args)
