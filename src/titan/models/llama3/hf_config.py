"""A Hugging Face Llama config.json to ModelArgs and back, with every architecture field checked.

Each mismatch is a user mistake reported in one line that names the field and the fix. transformers 5 keeps
rope_theta and the scaling in `rope_parameters`; older files (the released Llama 3.x folders) use `rope_theta`
and `rope_scaling`: both are read, the transformers 5 form is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from titan.models.llama3.model import ModelArgs
from titan.tools.cli import UserError

# ModelArgs field -> (config.json name, model.* key that sets it), for the one-line mismatch messages.
FIELDS = {
    "dim": ("hidden_size", "model.dim"),
    "n_layers": ("num_hidden_layers", "model.n_layers"),
    "n_heads": ("num_attention_heads", "model.n_heads"),
    "n_kv_heads": ("num_key_value_heads", "model.n_kv_heads"),
    "vocab_size": ("vocab_size", "model.vocab_size"),
    "ffn_hidden_dim": ("intermediate_size", "model.hidden_dim"),
    "norm_eps": ("rms_norm_eps", "model.norm_eps"),
    "rope_theta": ("rope_theta", "model.rope_theta"),
    "rope_scaling": ("rope_type", "model.rope_scaling"),
    "rope_factor": ("factor", "model.rope_factor"),
    "rope_low_freq_factor": ("low_freq_factor", "model.rope_low_freq_factor"),
    "rope_high_freq_factor": ("high_freq_factor", "model.rope_high_freq_factor"),
    "rope_original_max_seq_len": ("original_max_position_embeddings", "model.rope_original_max_seq_len"),
    "tie_embeddings": ("tie_word_embeddings", "model.tie_embeddings"),
}
# Fields with only one value in this model: anything else is refused rather than silently computed otherwise.
FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"{folder} has no config.json; point at a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def _rope(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "llama3":
        raise UserError(f"{source}: rope type {kind!r} is not supported; titan's Llama knows 'default' and 'llama3'")
    missing = [k for k in LLAMA3_KEYS if k not in rope]
    if missing:
        raise UserError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    return {
        "rope_theta": float(theta), "rope_scaling": "llama3", "rope_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        # transformers falls back to max_position_embeddings when the original context is not given.
        "rope_original_max_seq_len": int(rope.get("original_max_position_embeddings",
                                                  cfg.get("max_position_embeddings", 8192))),
    }


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """ModelArgs for a transformers LlamaConfig dict; refuses what this model cannot compute."""
    if cfg.get("model_type", "llama") != "llama":
        raise UserError(f"{source}: model_type {cfg.get('model_type')!r} is not a Llama")
    for key, value in FIXED.items():
        if cfg.get(key, value) != value:
            raise UserError(f"{source}: {key} = {cfg[key]!r} is not supported (titan's Llama has {value!r})")
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
            max_context_len=int(cfg.get("max_position_embeddings", 2048)), **_rope(cfg, source),
        )
    except KeyError as e:
        raise UserError(f"{source} lacks {e.args[0]}; is it a Llama config?") from None
    try:
        return ModelArgs(**fields)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def check_same_architecture(args: ModelArgs, hf_args: ModelArgs, source: str) -> None:
    """One line naming the first field where the run's model differs from the folder's."""
    for name, (hf_name, key) in FIELDS.items():
        ours, theirs = getattr(args, name), getattr(hf_args, name)
        if name == "n_kv_heads":
            ours, theirs = ours or args.n_heads, theirs or hf_args.n_heads
        if name.startswith("rope_") and name not in ("rope_theta", "rope_scaling") and args.rope_scaling == "none":
            continue
        if ours != theirs:
            raise UserError(f"{source} has {hf_name} = {theirs!r} but the run's model has {key} = {ours!r}; take "
                             "the architecture from the folder with --model.flavor hf, or fix the config")


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers LlamaConfig dict for these args, declaring the dtype the tensors are saved in."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": args.rope_factor,
                "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_seq_len}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        # The context the weights are made for, at least the length they were trained on here.
        "max_position_embeddings": max(args.max_context_len, args.max_seq_len,
                                       args.rope_original_max_seq_len if args.rope_scaling == "llama3" else 0),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings, "dtype": dtype,
    }

