"""A Hugging Face Llama config.json to ModelArgs and back, with every architecture field checked.

Each mismatch is a user mistake reported in one line that names the field and the fix; the transformers 5 form
of the RoPE fields is written.
"""

from __future__ import annotations

from typing import Any

from titan.hf import max_position_embeddings, rope_fields, rope_parameters
from titan.models.common.hf_adapter import DECODER_FIELDS, check_fixed
from titan.models.llama3.model import ModelArgs
from titan.tools.cli import UserError

FIELDS = DECODER_FIELDS
# Fields with only one value in this model: anything else is refused rather than silently computed otherwise.
FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """ModelArgs for a transformers LlamaConfig dict; refuses what this model cannot compute."""
    if cfg.get("model_type", "llama") != "llama":
        raise UserError(f"{source}: model_type {cfg.get('model_type')!r} is not a Llama")
    check_fixed(cfg, FIXED, source, "Llama")
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if cfg.get("head_dim") not in (None, dim // heads):
            raise UserError(f"{source}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads "
                             f"({dim // heads}), which titan's Llama needs")
        fields = dict(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), vocab_size=int(cfg["vocab_size"]),
            hidden_dim=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context_len=int(cfg.get("max_position_embeddings", 2048)), **rope_fields(cfg, source),
        )
    except KeyError as e:
        raise UserError(f"{source} lacks {e.args[0]}; is it a Llama config?") from None
    try:
        return ModelArgs(**fields)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers LlamaConfig dict for these args, declaring the dtype the tensors are saved in."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_parameters(args), "max_position_embeddings": max_position_embeddings(args),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings, "dtype": dtype,
    }
