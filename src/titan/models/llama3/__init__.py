"""Llama 3.1, registered as the `llama3` ModelSpec."""

from __future__ import annotations

import dataclasses

from titan.components.data import build_text_dataloader, build_tokenizer
from titan.models import register_model_spec
from titan.models.llama3.flavors import llama3_flavors
from titan.models.llama3.model import ModelArgs, Transformer, flops_per_token
from titan.models.llama3.parallelize import parallelize_llama
from titan.protocols.model_spec import ModelSpec


def update_model_args(args: ModelArgs, job_config, tokenizer) -> ModelArgs:
    """The vocabulary comes from the tokenizer; the RoPE table covers exactly the training sequence length
    (context parallel shards it along with the sequence)."""
    return dataclasses.replace(args, vocab_size=tokenizer.vocab_size, max_seq_len=job_config.training.seq_len)


llama3_spec = register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=llama3_flavors,
        build_model=Transformer,
        parallelize=parallelize_llama,
        build_dataloader=build_text_dataloader,
        build_tokenizer=build_tokenizer,
        update_model_args=update_model_args,
        flops_per_token=flops_per_token,
    )
)

__all__ = ["ModelArgs", "Transformer", "llama3_flavors", "llama3_spec", "parallelize_llama"]
