"""config.json <-> ModelArgs: Meta's published Llama 3.1 8B config is the 8B flavor, both rope spellings read the
same, the written form reads back, and what the model cannot compute is refused naming the field."""

import dataclasses

import pytest

from titan.hf import check_same_architecture
from titan.models.llama3 import llama3_flavors
from titan.models.llama3.hf_config import args_from_hf, hf_config
from titan.tools.cli import UserError

# meta-llama/Llama-3.1-8B's config.json (transformers 4 spelling: rope_theta and rope_scaling at the top).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def test_the_published_8b_config_is_the_8b_flavor():
    args = args_from_hf(LLAMA31_8B)
    assert (args.ffn_hidden_dim, args.rope_scaling, args.max_context_len) == (14336, "llama3", 131072)
    check_same_architecture(llama3_flavors["8B"], args, "config.json")


def test_transformers_5_rope_parameters_read_as_the_old_spelling():
    new = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert args_from_hf(new) == args_from_hf(LLAMA31_8B)


@pytest.mark.parametrize("flavor", ["8B", "3.2-1B", "debug"])
def test_the_written_config_reads_back_as_the_same_architecture(flavor):
    args = dataclasses.replace(llama3_flavors[flavor], max_seq_len=4096)
    written = hf_config(args, "bfloat16")
    assert written["dtype"] == "bfloat16" and written["head_dim"] == args.dim // args.n_heads
    check_same_architecture(args, args_from_hf(written), "config.json")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "config.json: model_type 'mistral' is not a Llama"),
    ({"hidden_act": "gelu"}, "config.json: hidden_act = 'gelu' is not supported (titan's Llama has 'silu')"),
    ({"head_dim": 64}, "config.json: head_dim 64 is not hidden_size / num_attention_heads (128)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "config.json: rope type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "config.json: llama3 rope scaling lacks low_freq_factor, high_freq_factor"),
    ({"vocab_size": None}, "config.json lacks vocab_size; is it a Llama config?"),
], ids=["model_type", "hidden_act", "head_dim", "yarn", "llama3-keys", "missing"])
def test_what_the_model_cannot_compute_is_refused_naming_the_field(change, message):
    cfg = {k: v for k, v in {**LLAMA31_8B, **change}.items() if v is not None}
    with pytest.raises(UserError) as err:
        args_from_hf(cfg)
    assert str(err.value).startswith(message)


def test_a_differing_field_names_the_config_name_and_the_model_key():
    with pytest.raises(UserError, match=r"^x/config.json has num_key_value_heads = 8 but the run's model has "
                                        r"model\.n_kv_heads = 4; take the architecture"):
        check_same_architecture(dataclasses.replace(llama3_flavors["8B"], n_kv_heads=4), args_from_hf(LLAMA31_8B),
                                "x/config.json")
