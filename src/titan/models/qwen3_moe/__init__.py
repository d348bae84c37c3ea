"""Qwen3-MoE, registered as the `qwen3_moe` ModelSpec and as the Hugging Face `qwen3_moe` model_type."""

from __future__ import annotations

from titan.models.common.family import register_decoder_family
from titan.models.common.parallelize import check_decoder_layout
from titan.models.qwen3_moe.flavors import qwen3_moe_flavors
from titan.models.qwen3_moe.hf_config import FIELDS, args_from_hf, from_hf, hf_config, to_hf
from titan.models.qwen3_moe.model import Qwen3MoeDecoder, Qwen3MoeModelArgs, flops_per_token

qwen3_moe_spec = register_decoder_family("qwen3_moe", "qwen3_moe", qwen3_moe_flavors, Qwen3MoeModelArgs,
                                         Qwen3MoeDecoder, flops_per_token, check_decoder_layout, FIELDS,
                                         args_from_hf, hf_config, to_hf, from_hf)

__all__ = ["Qwen3MoeDecoder", "Qwen3MoeModelArgs", "qwen3_moe_flavors", "qwen3_moe_spec"]
