"""Llama 3.x, registered as the `llama3` ModelSpec and as the Hugging Face `llama` model_type."""

from __future__ import annotations

from titan.models.common.decoder import flops_per_token
from titan.models.common.family import register_decoder_family
from titan.models.common.hf_adapter import from_hf, to_hf
from titan.models.common.parallelize import check_decoder_layout
from titan.models.llama3.flavors import llama3_flavors
from titan.models.llama3.hf_config import FIELDS, args_from_hf, hf_config
from titan.models.llama3.model import ModelArgs, Transformer

llama3_spec = register_decoder_family("llama3", "llama", llama3_flavors, ModelArgs, Transformer, flops_per_token,
                                      check_decoder_layout, FIELDS, args_from_hf, hf_config, to_hf, from_hf)

__all__ = ["ModelArgs", "Transformer", "llama3_flavors", "llama3_spec"]
