"""The Llama 3.x flavors have the published architectures: their exact parameter counts (Meta's figures, checked
against transformers' own model; tied embeddings counted once), the 3.2 models' RoPE scaling and tied embeddings,
the aliases."""

import pytest
import torch

from titan.models.common.decoder import num_params
from titan.models.llama3 import Transformer, llama3_flavors

# Meta's published counts; the HF shapes are those of each model's config.json (vocabulary 128,256).
PUBLISHED = {
    "3.2-1B": (1_235_814_400, dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   intermediate_size=8192, tie_word_embeddings=True)),
    "3.2-3B": (3_212_749_824, dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                   intermediate_size=8192, tie_word_embeddings=True)),
    "3.1-8B": (8_030_261_248, dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   intermediate_size=14336, tie_word_embeddings=False)),
    "3.1-70B": (70_553_706_496, dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                     intermediate_size=28672, tie_word_embeddings=False)),
    "3.1-405B": (405_853_388_800, dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                                       intermediate_size=53248, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_parameter_counts_on_meta(flavor):
    """Exact counts, checked against transformers' LlamaForCausalLM (a tied matrix counts once in both)."""
    transformers = pytest.importorskip("transformers")
    count, hf_shape = PUBLISHED[flavor]
    with torch.device("meta"):
        ours = Transformer(llama3_flavors[flavor])
        reference = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=128256, num_key_value_heads=8, **hf_shape))
    assert num_params(ours) == sum(p.numel() for p in reference.parameters()) == count


def test_llama32_ties_embeddings_and_scales_rope_by_32_llama31_unties_and_scales_by_8():
    small = [llama3_flavors[f] for f in ("3.2-1B", "3.2-3B")]
    assert all(a.tie_embeddings and a.rope_factor == 32.0 and a.n_kv_heads == 8 for a in small)
    assert all(not a.tie_embeddings and a.rope_factor == 8.0 for a in (llama3_flavors[f] for f in ("8B", "70B")))


def test_31_and_33_names_are_the_torchtitan_flavors():
    assert llama3_flavors["3.1-8B"] is llama3_flavors["8B"]
    assert llama3_flavors["3.1-70B"] is llama3_flavors["3.3-70B"] is llama3_flavors["70B"]
    assert llama3_flavors["3.1-405B"] is llama3_flavors["405B"]
