"""Qwen3 (dense), registered as the `qwen3` ModelSpec and as the Hugging Face `qwen3` model_type."""

from __future__ import annotations

from functools import partial

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.hf import HFFamily, load_hf_weights, register_hf_family
from titan.models import register_model_spec
from titan.models.common.decoder import Decoder, flops_per_token
from titan.models.common.hf_adapter import from_hf, to_hf
from titan.models.common.parallelize import parallelize_decoder
from titan.models.common.resolve import args_from_folder, update_model_args
from titan.models.qwen3.flavors import qwen3_flavors
from titan.models.qwen3.hf_config import FIELDS, args_from_hf, hf_config
from titan.models.qwen3.model import Qwen3ModelArgs
from titan.protocols.model_spec import ModelSpec

qwen3_spec = register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=qwen3_flavors,
        build_model=Decoder,
        parallelize=parallelize_decoder,
        build_dataloader=build_text_dataloader,
        build_tokenizer=build_tokenizer,
        update_model_args=update_model_args,
        flops_per_token=flops_per_token,
        args_from_folder=partial(args_from_folder, "qwen3"),
        load_hf_weights=load_hf_weights,
    )
)
register_hf_family(HFFamily("qwen3", "qwen3", Qwen3ModelArgs, FIELDS, args_from_hf, hf_config, to_hf, from_hf,
                            Decoder))

__all__ = ["Qwen3ModelArgs", "qwen3_flavors", "qwen3_spec"]
