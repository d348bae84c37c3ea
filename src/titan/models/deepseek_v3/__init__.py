"""DeepSeek-V3, registered as the `deepseek_v3` ModelSpec and as the Hugging Face `deepseek_v3` model_type."""

from __future__ import annotations

from titan.models.common.family import register_decoder_family
from titan.models.common.parallelize import check_decoder_layout
from titan.models.deepseek_v3.flavors import deepseek_v3_flavors
from titan.models.deepseek_v3.hf_adapter import FIELDS, args_from_hf, from_hf, hf_config, to_hf
from titan.models.deepseek_v3.model import ModelArgs, Transformer, flops_per_token

deepseek_v3_spec = register_decoder_family("deepseek_v3", "deepseek_v3", deepseek_v3_flavors, ModelArgs, Transformer,
                                           flops_per_token, check_decoder_layout, FIELDS, args_from_hf,
                                           hf_config, to_hf, from_hf)

__all__ = ["ModelArgs", "Transformer", "deepseek_v3_flavors", "deepseek_v3_spec"]
