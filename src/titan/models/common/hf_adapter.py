"""A Decoder's weights between titan's names and Hugging Face transformers' (LlamaForCausalLM, Qwen3ForCausalLM).

A family whose RoPE rotates interleaved (even, odd) pairs (Meta's Llama layout) needs the rows of wq and wk
permuted per head to compute the same function in HF's layout, which rotates the two halves: pair i of a head
moves to rows (i, i + head_dim/2). A family that rotates halves (Qwen3) maps names only.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan.models.common.decoder import DecoderArgs
from titan.tools.cli import UserError

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# DecoderArgs field -> (config.json name, model.* key that sets it), for the one-line mismatch messages.
DECODER_FIELDS = {
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
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (head, pair, 2) -> (head, 2, pair): Meta's interleaved rotary layout to HF's half split."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf(state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    kv_heads = args.n_kv_heads or args.n_heads
    hf = {}
    for key, value in state_dict.items():
        if key in _ROOT_NAMES:
            hf[_ROOT_NAMES[key]] = value
            continue
        m = _LAYER_KEY.match(key)
        if not m or m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"no Hugging Face name for parameter {key}")
        if args.rope_interleaved and m.group(2) == "attention.wq.weight":
            value = _to_half_split(value, args.n_heads)
        elif args.rope_interleaved and m.group(2) == "attention.wk.weight":
            value = _to_half_split(value, kv_heads)
        hf[f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"] = value.contiguous()
    return hf


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    kv_heads = args.n_kv_heads or args.n_heads
    root = {v: k for k, v in _ROOT_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    sd = {}
    for key, value in hf_state_dict.items():
        if key in root:
            sd[root[key]] = value
            continue
        m = _HF_LAYER_KEY.match(key)
        if not m or m.group(2) not in layer:
            if key.endswith("rotary_emb.inv_freq"):
                continue  # a cached buffer some exports carry
            raise UserError(f"unknown Hugging Face parameter {key} (no counterpart in {type(args).__name__})")
        name = layer[m.group(2)]
        if args.rope_interleaved and name == "attention.wq.weight":
            value = _to_interleaved(value, args.n_heads)
        elif args.rope_interleaved and name == "attention.wk.weight":
            value = _to_interleaved(value, kv_heads)
        sd[f"layers.{m.group(1)}.{name}"] = value.contiguous()
    return sd


def check_fixed(cfg: dict[str, Any], fixed: dict[str, Any], source: str, family: str) -> None:
    """Refuses a config.json field whose value the family cannot compute (one line naming it)."""
    for key, value in fixed.items():
        if cfg.get(key, value) != value:
            raise UserError(f"{source}: {key} = {cfg[key]!r} is not supported (titan's {family} has {value!r})")
