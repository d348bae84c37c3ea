"""A Hugging Face Llama config.json to ModelArgs and back, with every architecture field checked.

Each mismatch is a user mistake reported in one line that names the field and the fix; the transformers 5 form
of the RoPE fields is written.
"""

from __future__ import annotations

from typing import Any

from titan.models.common.hf_adapter import DECODER_FIELDS, HFDecoderConfig, decoder_args_from_hf, decoder_hf_config
from titan.models.llama3.model import ModelArgs

FIELDS = DECODER_FIELDS
HF = HFDecoderConfig("llama", "Llama", "LlamaForCausalLM", default_context=2048, own_head_dim=False,
                     fixed={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                            "attention_dropout": 0.0})


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """ModelArgs for a transformers LlamaConfig dict; refuses what this model cannot compute."""
    return decoder_args_from_hf(cfg, HF, ModelArgs, source)


def hf_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers LlamaConfig dict for these args, declaring the dtype the tensors are saved in."""
    return decoder_hf_config(args, dtype, HF)
