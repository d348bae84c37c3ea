"""The Qwen3 dense flavors have the published architectures: each equals what its Qwen/Qwen3-*/config.json
imports as, and has exactly the parameters of transformers' Qwen3ForCausalLM built from that config (tied
embeddings counted once)."""

import dataclasses

import pytest
import torch

from titan.models.common.decoder import Decoder, num_params
from titan.models.qwen3 import qwen3_flavors
from titan.models.qwen3.hf_config import args_from_hf

# The architecture fields of the published config.json files (all: vocabulary 151,936, head_dim 128, 8 KV heads,
# rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40,960), and the parameter count they give.
COMMON = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, rope_theta=1000000.0,
              rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu", attention_bias=False,
              use_sliding_window=False)
PUBLISHED = {
    "0.6B": (596_049_920, dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                               num_attention_heads=16, tie_word_embeddings=True)),
    "1.7B": (1_720_574_976, dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True)),
    "4B": (4_022_468_096, dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=True)),
    "8B": (8_190_735_360, dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=False)),
    "14B": (14_768_307_200, dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                 num_attention_heads=40, tie_word_embeddings=False)),
    "32B": (32_762_123_264, dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                 num_attention_heads=64, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_flavors_are_the_published_configs(flavor):
    published = args_from_hf({**COMMON, **PUBLISHED[flavor][1]})
    assert dataclasses.replace(published, max_seq_len=qwen3_flavors[flavor].max_seq_len) == qwen3_flavors[flavor]


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_parameter_counts_on_meta(flavor):
    transformers = pytest.importorskip("transformers")
    count, hf_shape = PUBLISHED[flavor]
    config = {k: v for k, v in COMMON.items() if k != "model_type"}
    with torch.device("meta"):
        ours = Decoder(qwen3_flavors[flavor])
        reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config, **hf_shape))
    assert num_params(ours) == sum(p.numel() for p in reference.parameters()) == count


def test_debug_flavor_is_small_and_has_its_own_head_dim():
    args = qwen3_flavors["debug"]
    assert args.head_dim * args.n_heads != args.dim
    with torch.device("meta"):
        assert num_params(Decoder(args)) < 10_000_000
