"""Llama 3 weights between titan (Meta's layout) and Hugging Face transformers' layout.

Meta rotates interleaved (even, odd) pairs of each head dimension; HF rotates the two halves. The same
function in HF's layout needs the rows of wq and wk permuted per head: pair i of a head moves to rows
(i, i + head_dim/2).
"""

from __future__ import annotations

import re

import torch

from titan.models.llama3.model import ModelArgs
from titan.tools.cli import UserError

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
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
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (head, pair, 2) -> (head, 2, pair): Meta's interleaved rotary layout to HF's half split."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    kv_heads = args.n_kv_heads or args.n_heads
    hf = {}
    for key, value in state_dict.items():
        if key in _ROOT_NAMES:
            hf[_ROOT_NAMES[key]] = value
            continue
        m = _LAYER_KEY.match(key)
        if not m or m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"no Hugging Face name for parameter {key}")
        if m.group(2) == "attention.wq.weight":
            value = _to_half_split(value, args.n_heads)
        elif m.group(2) == "attention.wk.weight":
            value = _to_half_split(value, kv_heads)
        hf[f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"] = value.contiguous()
    return hf


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
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
            raise UserError(f"unknown Hugging Face Llama parameter {key}")
        name = layer[m.group(2)]
        if name == "attention.wq.weight":
            value = _to_interleaved(value, args.n_heads)
        elif name == "attention.wk.weight":
            value = _to_interleaved(value, kv_heads)
        sd[f"layers.{m.group(1)}.{name}"] = value.contiguous()
    return sd

