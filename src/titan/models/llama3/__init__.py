"""Llama 3.x, registered as the `llama3` ModelSpec."""

from __future__ import annotations

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.models import register_model_spec
from titan.models.common.decoder import flops_per_token
from titan.models.common.parallelize import parallelize_decoder
from titan.models.llama3.flavors import llama3_flavors
from titan.models.llama3.hf_files import load_hf_weights
from titan.models.llama3.model import ModelArgs, Transformer
from titan.models.llama3.resolve import args_from_folder, update_model_args
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
        args_from_folder=args_from_folder,
        load_hf_weights=load_hf_weights,
    )
)

__all__ = ["ModelArgs", "Transformer", "llama3_flavors", "llama3_spec"]
