"""DeepSeek-V3 between titan and Hugging Face: config.json <-> ModelArgs, and weights in the published checkpoint
layout (one tensor per expert and projection, `mlp.experts.<j>.gate_proj.weight`) <-> titan's grouped [E, ...]
tensors.

The rotary part of queries and keys is rotated in interleaved pairs, the layout of DeepSeek's checkpoints
(`rope_interleave: true`, transformers' default); a folder with `rope_interleave: false` has those rows in the
half-split layout and is permuted on import. Exports are written interleaved.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan.models.common.hf_adapter import (
    EXPERT_PROJECTIONS,
    check_fixed,
    experts_to_hf,
    rename_from_hf,
    rename_to_hf,
    stack_experts,
)
from titan.models.deepseek_v3.model import ModelArgs
from titan.tools.cli import UserError

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_ROOT_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
_EXPERTS_KEY = re.compile(r"^layers\.(\d+)\.moe\.experts\.(.+)$")
# ModelArgs field -> (config.json name, model.* key that sets it), for the one-line mismatch messages.
FIELDS = {name: (hf, f"model.{name}") for name, hf in (
    ("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_dense_layers", "first_k_dense_replace"),
    ("n_heads", "num_attention_heads"), ("vocab_size", "vocab_size"), ("inter_dim", "intermediate_size"),
    ("moe_inter_dim", "moe_intermediate_size"), ("n_routed_experts", "n_routed_experts"),
    ("n_shared_experts", "n_shared_experts"), ("n_activated_experts", "num_experts_per_tok"),
    ("n_expert_groups", "n_group"), ("n_limited_groups", "topk_group"), ("route_norm", "norm_topk_prob"),
    ("route_scale", "routed_scaling_factor"), ("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_nope_head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"), ("norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"),
    ("rope_factor", "factor"), ("rope_original_max_seq_len", "original_max_position_embeddings"),
    ("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow"), ("rope_mscale", "mscale"),
    ("rope_mscale_all_dim", "mscale_all_dim"))}
FIXED = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "attention_dropout": 0.0}


def _rope_rows(args: ModelArgs, key: str) -> tuple[int, int] | None:
    """(rows per block, rotary rows at the end of each block) of a weight whose rows hold rotary parts."""
    rope = args.qk_rope_head_dim
    if key in ("attention.wq.weight", "attention.wq_b.weight"):
        return args.qk_nope_head_dim + rope, rope
    if key == "attention.wkv_a.weight":
        return args.kv_lora_rank + rope, rope
    return None


def _interleave(w: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """Half-split rotary rows (x_0..x_{R/2-1}, y_0..) of each block -> interleaved (x_0, y_0, x_1, ...)."""
    block, rope = rows
    w = w.view(-1, block, w.shape[-1]).clone()
    w[:, block - rope:] = w[:, block - rope:].view(-1, 2, rope // 2, w.shape[-1]).transpose(1, 2).reshape(
        -1, rope, w.shape[-1])
    return w.view(-1, w.shape[-1])


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    rest, hf = {}, {}
    for key, value in state_dict.items():
        m = _EXPERTS_KEY.match(key)
        if m and m.group(2) in EXPERT_PROJECTIONS:
            hf |= experts_to_hf(f"model.layers.{m.group(1)}.mlp.experts", m.group(2), value)
        else:
            rest[key] = value
    return {**rename_to_hf(rest, _ROOT_NAMES, _LAYER_NAMES, lambda _, value: value), **hf}


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    layer_names = _LAYER_NAMES | {f"moe.experts.{k}": f"mlp.experts.{k}" for k in EXPERT_PROJECTIONS}

    def convert(name: str, value: torch.Tensor) -> torch.Tensor:
        rows = _rope_rows(args, name)
        return _interleave(value, rows) if rows and not args.rope_interleave else value

    return rename_from_hf(stack_experts(hf_state_dict, args.n_routed_experts), _ROOT_NAMES, layer_names,
                          "DeepSeek-V3", convert)


def _rope_args(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_factor": 1.0, "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0}
    if kind != "yarn":
        raise UserError(f"config.json: rope type {kind!r} is not supported; titan's DeepSeek-V3 knows 'default' "
                        "and 'yarn'")
    if rope.get("attention_factor") is not None or not rope.get("truncate", True):
        raise UserError("config.json: yarn attention_factor and truncate = false are not supported")
    original = int(rope.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)))
    factor = rope.get("factor") or cfg["max_position_embeddings"] / original
    return {"rope_theta": theta, "rope_factor": float(factor), "rope_original_max_seq_len": original,
            "rope_beta_fast": float(rope.get("beta_fast") or 32), "rope_beta_slow": float(rope.get("beta_slow") or 1),
            "rope_mscale": float(rope.get("mscale") or 0),
            "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0)}


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """ModelArgs for a transformers DeepseekV3Config dict; refuses what this model cannot compute."""
    if cfg.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise UserError(f"{source}: model_type {cfg.get('model_type')!r} is not deepseek_v3")
    check_fixed(cfg, FIXED, source, "DeepSeek-V3")
    try:
        heads = int(cfg["num_attention_heads"])
        if int(cfg.get("num_key_value_heads") or heads) != heads:
            raise UserError(f"{source}: num_key_value_heads must equal num_attention_heads for MLA")
        fields = dict(
            dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
            n_dense_layers=int(cfg.get("first_k_dense_replace") or 0), n_heads=heads,
            vocab_size=int(cfg["vocab_size"]), inter_dim=int(cfg["intermediate_size"]),
            moe_inter_dim=int(cfg["moe_intermediate_size"]), n_routed_experts=int(cfg["n_routed_experts"]),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            n_activated_experts=int(cfg["num_experts_per_tok"]), n_expert_groups=int(cfg.get("n_group") or 1),
            n_limited_groups=int(cfg.get("topk_group") or 1), score_func="sigmoid",
            route_norm=bool(cfg.get("norm_topk_prob", True)), route_scale=float(cfg.get("routed_scaling_factor", 1)),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_context_len=int(cfg.get("max_position_embeddings", 4096)),
            rope_interleave=bool(cfg.get("rope_interleave", True)), **_rope_args(cfg),
        )
    except KeyError as e:
        raise UserError(f"{source} lacks {e.args[0]}; is it a DeepSeek-V3 config?") from None
    try:
        return ModelArgs(**fields)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers DeepseekV3Config dict for these args, declaring the dtype the tensors are saved in."""
    if args.score_func != "sigmoid":
        raise UserError("transformers' DeepSeek-V3 routes with sigmoid scores; a softmax-routed model has no export")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor != 1:
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.rope_factor,
                "original_max_position_embeddings": args.rope_original_max_seq_len,
                "beta_fast": args.rope_beta_fast, "beta_slow": args.rope_beta_slow}
        rope |= {k: v for k, v in (("mscale", args.rope_mscale), ("mscale_all_dim", args.rope_mscale_all_dim)) if v}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers, "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads, "vocab_size": args.vocab_size,
        "intermediate_size": args.inter_dim, "moe_intermediate_size": args.moe_inter_dim,
        "n_routed_experts": args.n_routed_experts, "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.n_activated_experts, "n_group": args.n_expert_groups,
        "topk_group": args.n_limited_groups, "norm_topk_prob": args.route_norm,
        "routed_scaling_factor": args.route_scale, "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim, "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope, "rope_interleave": True,
        "max_position_embeddings": max(args.max_context_len, args.max_seq_len),
        "num_nextn_predict_layers": 0, **FIXED, "dtype": dtype,
    }
