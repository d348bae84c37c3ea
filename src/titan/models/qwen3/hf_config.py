"""A Hugging Face Qwen3 config.json to Qwen3ModelArgs and back, with every architecture field checked."""

from __future__ import annotations

from typing import Any

from titan.hf import max_position_embeddings, rope_fields, rope_parameters
from titan.models.common.hf_adapter import DECODER_FIELDS, check_fixed
from titan.models.qwen3.model import Qwen3ModelArgs
from titan.tools.cli import UserError

# Qwen3ModelArgs field -> (config.json name, model.* key that sets it): the decoder's, plus the head width.
FIELDS = {**DECODER_FIELDS, "head_dim": ("head_dim", "model.head_dim")}
# Sliding-window attention is off in every released Qwen3 dense model; refused rather than ignored.
FIXED = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False}


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> Qwen3ModelArgs:
    """Qwen3ModelArgs for a transformers Qwen3Config dict; refuses what this model cannot compute."""
    if cfg.get("model_type", "qwen3") != "qwen3":
        raise UserError(f"{source}: model_type {cfg.get('model_type')!r} is not a Qwen3")
    check_fixed(cfg, FIXED, source, "Qwen3")
    try:
        heads = int(cfg["num_attention_heads"])
        fields = dict(
            dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim", 128)),
            vocab_size=int(cfg["vocab_size"]), hidden_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context_len=int(cfg.get("max_position_embeddings", 32768)), **rope_fields(cfg, source),
        )
    except KeyError as e:
        raise UserError(f"{source} lacks {e.args[0]}; is it a Qwen3 config?") from None
    try:
        return Qwen3ModelArgs(**fields)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def hf_config(args: Qwen3ModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers Qwen3Config dict for these args, declaring the dtype the tensors are saved in."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_parameters(args), "max_position_embeddings": max_position_embeddings(args),
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "tie_word_embeddings": args.tie_embeddings, "dtype": dtype,
    }
