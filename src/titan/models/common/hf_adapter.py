"""A Decoder's weights between titan's names and Hugging Face transformers' (LlamaForCausalLM, Qwen3ForCausalLM).

A family whose RoPE rotates interleaved (even, odd) pairs (Meta's Llama layout) needs the rows of wq and wk
permuted per head to compute the same function in HF's layout, which rotates the two halves: pair i of a head
moves to rows (i, i + head_dim/2). A family that rotates halves (Qwen3) maps names only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from titan.hf import max_position_embeddings, rope_fields, rope_parameters
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
    heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": kv_heads}

    def convert(name: str, value: torch.Tensor) -> torch.Tensor:
        return _to_half_split(value, heads[name]) if args.rope_interleaved and name in heads else value

    return rename_to_hf(state_dict, _ROOT_NAMES, _LAYER_NAMES, convert)


def rename_to_hf(state_dict: dict[str, torch.Tensor], root_names: dict[str, str], layer_names: dict[str, str],
                 convert) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict from titan's through name tables (titan name -> HF name, at the root and inside each
    `layers.<i>.`), the inverse of rename_from_hf; `convert(name, value)` rewrites a layer tensor. A name with no
    counterpart is our bug (the model and its tables disagree): ValueError."""
    hf = {}
    for key, value in state_dict.items():
        if key in root_names:
            hf[root_names[key]] = value
            continue
        m = _LAYER_KEY.match(key)
        if not m or m.group(2) not in layer_names:
            raise ValueError(f"no Hugging Face name for parameter {key}")
        hf[f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"] = convert(m.group(2), value).contiguous()
    return hf


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    kv_heads = args.n_kv_heads or args.n_heads

    def convert(name: str, value: torch.Tensor) -> torch.Tensor:
        if args.rope_interleaved and name == "attention.wq.weight":
            value = _to_interleaved(value, args.n_heads)
        elif args.rope_interleaved and name == "attention.wk.weight":
            value = _to_interleaved(value, kv_heads)
        return value.contiguous()

    return rename_from_hf(hf_state_dict, _ROOT_NAMES, _LAYER_NAMES, type(args).__name__, convert)


def rename_from_hf(hf_state_dict: dict[str, torch.Tensor], root_names: dict[str, str], layer_names: dict[str, str],
                   family: str, convert) -> dict[str, torch.Tensor]:
    """titan's state dict from a Hugging Face one through name tables (titan name -> HF name, at the root and inside
    each `model.layers.<i>.`); `convert(name, value)` rewrites a layer tensor (e.g. its RoPE row order). A name with
    no counterpart is one error line; a cached `rotary_emb.inv_freq` is skipped."""
    root = {v: k for k, v in root_names.items()}
    layer = {v: k for k, v in layer_names.items()}
    sd = {}
    for key, value in hf_state_dict.items():
        if key in root:
            sd[root[key]] = value
            continue
        m = _HF_LAYER_KEY.match(key)
        if not m or m.group(2) not in layer:
            if key.endswith("rotary_emb.inv_freq"):
                continue  # a cached buffer some exports carry
            raise UserError(f"unknown Hugging Face parameter {key} (no counterpart in {family})")
        name = layer[m.group(2)]
        sd[f"layers.{m.group(1)}.{name}"] = convert(name, value)
    return sd


def check_fixed(cfg: dict[str, Any], fixed: dict[str, Any], source: str, family: str) -> None:
    """Refuses a config.json field whose value the family cannot compute (one line naming it)."""
    for key, value in fixed.items():
        if cfg.get(key, value) != value:
            raise UserError(f"{source}: {key} = {cfg[key]!r} is not supported (titan's {family} has {value!r})")


@dataclass(frozen=True)
class HFDecoderConfig:
    """How a dense decoder family's args read and write a transformers config.json."""

    model_type: str
    family: str
    """The family's name in messages, e.g. Llama."""
    architecture: str
    fixed: dict[str, Any]
    """config.json fields with only one value in this family: any other value is refused, not computed otherwise."""
    default_context: int
    """max_position_embeddings when config.json has none (transformers' default for the family)."""
    own_head_dim: bool
    """head_dim is a field of its own (Qwen3), not hidden_size / num_attention_heads (Llama)."""


def decoder_args_from_hf(cfg: dict[str, Any], hf: HFDecoderConfig, args_cls: type, source: str):
    """`args_cls` for a transformers config dict of the family `hf`; refuses what the model cannot compute."""
    if cfg.get("model_type", hf.model_type) != hf.model_type:
        raise UserError(f"{source}: model_type {cfg.get('model_type')!r} is not a {hf.family}")
    check_fixed(cfg, hf.fixed, source, hf.family)
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hf.own_head_dim:
            head = {"head_dim": int(cfg.get("head_dim", 128))}
        elif cfg.get("head_dim") not in (None, dim // heads):
            raise UserError(f"{source}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads "
                            f"({dim // heads}), which titan's {hf.family} needs")
        else:
            head = {}
        fields = dict(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), **head, vocab_size=int(cfg["vocab_size"]),
            hidden_dim=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context_len=int(cfg.get("max_position_embeddings", hf.default_context)), **rope_fields(cfg, source),
        )
    except KeyError as e:
        raise UserError(f"{source} lacks {e.args[0]}; is it a {hf.family} config?") from None
    try:
        return args_cls(**fields)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def decoder_hf_config(args: DecoderArgs, dtype: str, hf: HFDecoderConfig) -> dict[str, Any]:
    """A transformers config dict of the family `hf` for these args, declaring the dtype the tensors are saved in."""
    return {
        "architectures": [hf.architecture], "model_type": hf.model_type, "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_parameters(args), "max_position_embeddings": max_position_embeddings(args),
        **hf.fixed, "tie_word_embeddings": args.tie_embeddings, "dtype": dtype,
    }


# Routed experts: titan holds one [E, out, in] tensor per projection, Hugging Face checkpoints one tensor per expert
# (`<layer>.mlp.experts.<j>.gate_proj.weight`).
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_EXPERT_KEY = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")


def experts_to_hf(hf_prefix: str, projection: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One grouped [E, out, in] tensor (w1, w2 or w3) -> E tensors `<hf_prefix>.<j>.<gate|down|up>_proj.weight`."""
    name = EXPERT_PROJECTIONS[projection]
    return {f"{hf_prefix}.{j}.{name}.weight": w.contiguous() for j, w in enumerate(value.unbind(0))}


def stack_experts(hf_state_dict: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The state dict with each layer's per-expert tensors stacked into `<prefix>.experts.<w1|w2|w3>` [E, out, in];
    every expert 0..E-1 must be there."""
    out, groups = {}, {}
    for key, value in hf_state_dict.items():
        m = _HF_EXPERT_KEY.match(key)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
        else:
            out[key] = value
    ours = {v: k for k, v in EXPERT_PROJECTIONS.items()}
    for (prefix, name), tensors in groups.items():
        if sorted(tensors) != list(range(num_experts)):
            raise UserError(f"{prefix} holds {len(tensors)} experts' {name}, not the {num_experts} of config.json")
        out[f"{prefix}.{ours[name]}"] = torch.stack([tensors[j] for j in range(num_experts)])
    return out
