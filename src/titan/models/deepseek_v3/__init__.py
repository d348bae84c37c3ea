"""DeepSeek-V3, registered as the `deepseek_v3` ModelSpec and as the Hugging Face `deepseek_v3` model_type."""

from __future__ import annotations

from functools import partial

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.hf import HFFamily, load_hf_weights, register_hf_family
from titan.models import register_model_spec
from titan.models.common.parallelize import check_sparse_decoder_layout, parallelize_decoder
from titan.models.common.resolve import args_from_folder, update_model_args
from titan.models.deepseek_v3.flavors import deepseek_v3_flavors
from titan.models.deepseek_v3.hf_adapter import FIELDS, args_from_hf, from_hf, hf_config, to_hf
from titan.models.deepseek_v3.model import ModelArgs, Transformer, flops_per_token
from titan.protocols.model_spec import ModelSpec

deepseek_v3_spec = register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        flavors=deepseek_v3_flavors,
        build_model=Transformer,
        parallelize=parallelize_decoder,
        build_dataloader=build_text_dataloader,
        build_tokenizer=build_tokenizer,
        update_model_args=update_model_args,
        flops_per_token=flops_per_token,
        args_from_folder=partial(args_from_folder, "deepseek_v3"),
        load_hf_weights=load_hf_weights,
        check_layout=check_sparse_decoder_layout,
    )
)
register_hf_family(HFFamily("deepseek_v3", "deepseek_v3", ModelArgs, FIELDS, args_from_hf, hf_config, to_hf,
                            from_hf, Transformer))

__all__ = ["ModelArgs", "Transformer", "deepseek_v3_flavors", "deepseek_v3_spec"]
