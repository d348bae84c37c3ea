"""Llama 3.x, registered as the `llama3` ModelSpec and as the Hugging Face `llama` model_type."""

from __future__ import annotations

from functools import partial

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.hf import HFFamily, load_hf_weights, register_hf_family
from titan.models import register_model_spec
from titan.models.common.decoder import flops_per_token
from titan.models.common.hf_adapter import from_hf, to_hf
from titan.models.common.parallelize import parallelize_decoder
from titan.models.common.resolve import args_from_folder, update_model_args
from titan.models.llama3.flavors import llama3_flavors
from titan.models.llama3.hf_config import FIELDS, args_from_hf, hf_config
from titan.models.llama3.model import ModelArgs, Transformer
from titan.protocols.model_spec import ModelSpec

llama3_spec = register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=llama3_flavors,
        build_model=Transformer,
        parallelize=parallelize_decoder,
        build_dataloader=build_text_dataloader,
        build_tokenizer=build_tokenizer,
        update_model_args=update_model_args,
        flops_per_token=flops_per_token,
        args_from_folder=partial(args_from_folder, "llama"),
        load_hf_weights=load_hf_weights,
    )
)
register_hf_family(HFFamily("llama", "llama3", ModelArgs, FIELDS, args_from_hf, hf_config, to_hf, from_hf,
                            Transformer))

__all__ = ["ModelArgs", "Transformer", "llama3_flavors", "llama3_spec"]
