"""Registering a decoder family: its ModelSpec (the shared text data, tokenizer, run-args resolution and
parallelization) and its Hugging Face model_type, from what the family itself owns."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.hf import HFFamily, load_hf_weights, register_hf_family
from titan.models import register_model_spec
from titan.models.common.parallelize import parallelize_decoder
from titan.models.common.resolve import args_from_folder, update_model_args
from titan.protocols.model_spec import ModelSpec


def register_decoder_family(name: str, model_type: str, flavors: dict[str, Any], args_cls: type, build_model: type,
                            flops_per_token: Callable, check_layout: Callable, fields: dict,
                            args_from_hf: Callable, hf_config: Callable, to_hf: Callable,
                            from_hf: Callable) -> ModelSpec:
    """Registers the family `name` (Hugging Face `model_type`) and returns its ModelSpec."""
    spec = register_model_spec(
        ModelSpec(
            name=name,
            flavors=flavors,
            build_model=build_model,
            parallelize=parallelize_decoder,
            build_dataloader=build_text_dataloader,
            build_tokenizer=build_tokenizer,
            update_model_args=update_model_args,
            flops_per_token=flops_per_token,
            args_from_folder=partial(args_from_folder, model_type),
            load_hf_weights=load_hf_weights,
            check_layout=check_layout,
        )
    )
    register_hf_family(HFFamily(model_type, name, args_cls, fields, args_from_hf, hf_config, to_hf, from_hf,
                                build_model))
    return spec
