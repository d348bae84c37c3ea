"""Qwen3-MoE, registered as the `qwen3_moe` ModelSpec and as the Hugging Face `qwen3_moe` model_type."""

from __future__ import annotations

from functools import partial

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.hf import HFFamily, load_hf_weights, register_hf_family
from titan.models import register_model_spec
from titan.models.common.parallelize import check_sparse_decoder_layout, parallelize_decoder
from titan.models.common.resolve import args_from_folder, update_model_args
from titan.models.qwen3_moe.flavors import qwen3_moe_flavors
from titan.models.qwen3_moe.hf_config import FIELDS, args_from_hf, from_hf, hf_config, to_hf
from titan.models.qwen3_moe.model import Qwen3MoeDecoder, Qwen3MoeModelArgs, flops_per_token
from titan.protocols.model_spec import ModelSpec

qwen3_moe_spec = register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        flavors=qwen3_moe_flavors,
        build_model=Qwen3MoeDecoder,
        parallelize=parallelize_decoder,
        build_dataloader=build_text_dataloader,
        build_tokenizer=build_tokenizer,
        update_model_args=update_model_args,
        flops_per_token=flops_per_token,
        args_from_folder=partial(args_from_folder, "qwen3_moe"),
        load_hf_weights=load_hf_weights,
        check_layout=check_sparse_decoder_layout,
    )
)
register_hf_family(HFFamily("qwen3_moe", "qwen3_moe", Qwen3MoeModelArgs, FIELDS, args_from_hf, hf_config, to_hf,
                            from_hf, Qwen3MoeDecoder))

__all__ = ["Qwen3MoeDecoder", "Qwen3MoeModelArgs", "qwen3_moe_flavors", "qwen3_moe_spec"]
