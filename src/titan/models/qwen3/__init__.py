"""Qwen3 (dense), registered as the `qwen3` ModelSpec and as the Hugging Face `qwen3` model_type."""

from __future__ import annotations

from titan.models.common.decoder import Decoder, flops_per_token
from titan.models.common.family import register_decoder_family
from titan.models.common.hf_adapter import from_hf, to_hf
from titan.models.common.parallelize import check_decoder_layout
from titan.models.qwen3.flavors import qwen3_flavors
from titan.models.qwen3.hf_config import FIELDS, args_from_hf, hf_config
from titan.models.qwen3.model import Qwen3ModelArgs

qwen3_spec = register_decoder_family("qwen3", "qwen3", qwen3_flavors, Qwen3ModelArgs, Decoder, flops_per_token,
                                     check_decoder_layout, FIELDS, args_from_hf, hf_config, to_hf, from_hf)

__all__ = ["Qwen3ModelArgs", "qwen3_flavors", "qwen3_spec"]
