"""A Hugging Face Qwen3 config.json to Qwen3ModelArgs and back, with every architecture field checked."""

from __future__ import annotations

from typing import Any

from titan.models.common.hf_adapter import DECODER_FIELDS, HFDecoderConfig, decoder_args_from_hf, decoder_hf_config
from titan.models.qwen3.model import Qwen3ModelArgs

# Qwen3ModelArgs field -> (config.json name, model.* key that sets it): the decoder's, plus the head width.
FIELDS = {**DECODER_FIELDS, "head_dim": ("head_dim", "model.head_dim")}
# Sliding-window attention is off in every released Qwen3 dense model; refused rather than ignored.
HF = HFDecoderConfig("qwen3", "Qwen3", "Qwen3ForCausalLM", default_context=32768, own_head_dim=True,
                     fixed={"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
                            "use_sliding_window": False})


def args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> Qwen3ModelArgs:
    """Qwen3ModelArgs for a transformers Qwen3Config dict; refuses what this model cannot compute."""
    return decoder_args_from_hf(cfg, HF, Qwen3ModelArgs, source)


def hf_config(args: Qwen3ModelArgs, dtype: str) -> dict[str, Any]:
    """A transformers Qwen3Config dict for these args, declaring the dtype the tensors are saved in."""
    return decoder_hf_config(args, dtype, HF)
