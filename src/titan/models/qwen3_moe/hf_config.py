"""Qwen3-MoE between titan and Hugging Face: config.json <-> Qwen3MoeModelArgs (Qwen3's fields and the experts'),
and the weights: Qwen3's names, with each sparse block's router (`mlp.gate`) and per-expert tensors
(`mlp.experts.<j>.gate_proj.weight`) <-> titan's `feed_forward.router.gate` and grouped [E, ...] tensors."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titan.models.common import hf_adapter as common
from titan.models.qwen3.hf_config import FIELDS as QWEN3_FIELDS
from titan.models.qwen3.hf_config import args_from_hf as qwen3_args_from_hf
from titan.models.qwen3.hf_config import hf_config as qwen3_hf_config
from titan.models.qwen3_moe.model import Qwen3MoeModelArgs
from titan.tools.cli import UserError

FIELDS = {**QWEN3_FIELDS, **{name: (hf, f"model.{name}") for name, hf in (
    ("moe_hidden_dim", "moe_intermediate_size"), ("num_experts", "num_experts"), ("top_k", "num_experts_per_tok"),
    ("route_norm", "norm_topk_prob"), ("decoder_sparse_step", "decoder_sparse_step"),
    ("mlp_only_layers", "mlp_only_layers"))}}
_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(router\.gate\.weight|experts\.w[123])$")
_HF_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.w[123])$")


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> Qwen3MoeModelArgs:
    """Qwen3MoeModelArgs for a transformers Qwen3MoeConfig dict; refuses what this model cannot compute."""
    if cfg.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise UserError(f"{source}: model_type {cfg.get('model_type')!r} is not a Qwen3-MoE")
    base = qwen3_args_from_hf({**cfg, "model_type": "qwen3"}, source)
    try:
        # Released configs say num_experts; transformers 5 writes num_local_experts.
        experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        moe = dict(moe_hidden_dim=int(cfg["moe_intermediate_size"]), num_experts=int(experts),
                   top_k=int(cfg["num_experts_per_tok"]), route_norm=bool(cfg.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                   mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
                   aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)))
    except KeyError as e:
        raise UserError(f"{source} lacks {e.args[0]}; is it a Qwen3-MoE config?") from None
    try:
        return Qwen3MoeModelArgs(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **moe)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def hf_config(args: Qwen3MoeModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers Qwen3MoeConfig dict for these args, declaring the dtype the tensors are saved in."""
    return {**qwen3_hf_config(args, dtype), "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": args.moe_hidden_dim, "num_experts": args.num_experts,
            "num_experts_per_tok": args.top_k, "norm_topk_prob": args.route_norm,
            "decoder_sparse_step": args.decoder_sparse_step, "mlp_only_layers": list(args.mlp_only_layers),
            "router_aux_loss_coef": args.aux_loss_coef}


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3MoeModelArgs) -> dict[str, torch.Tensor]:
    dense, hf = {}, {}
    for key, value in state_dict.items():
        m = _MOE.match(key)
        if not m:
            dense[key] = value
        elif m.group(2) == "router.gate.weight":
            hf[f"model.layers.{m.group(1)}.mlp.gate.weight"] = value
        else:
            hf |= common.experts_to_hf(f"model.layers.{m.group(1)}.mlp.experts", m.group(2)[-2:], value)
    return {**common.to_hf(dense, args), **hf}


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3MoeModelArgs) -> dict[str, torch.Tensor]:
    dense, sd = {}, {}
    for key, value in common.stack_experts(hf_state_dict, args.num_experts).items():
        m = _HF_MOE.match(key)
        if not m:
            dense[key] = value
        elif m.group(2) == "gate.weight":
            sd[f"layers.{m.group(1)}.feed_forward.router.gate.weight"] = value
        else:
            sd[f"layers.{m.group(1)}.feed_forward.{m.group(2)}"] = value
    return {**common.from_hf(dense, args), **sd}
