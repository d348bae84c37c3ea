"""The Llama 3.x flavors have the published architectures: their exact parameter counts (Hugging Face's model
cards, tied embeddings counted once), the 3.2 models' RoPE scaling and tied embeddings, the aliases."""

import pytest
import torch

from titan.models.llama3 import Transformer, llama3_flavors
from titan.models.llama3.model import num_params


@pytest.mark.parametrize("flavor, count", [("3.2-1B", 1_235_814_400), ("3.2-3B", 3_212_749_824),
                                           ("8B", 8_030_261_248), ("70B", 70_553_706_496),
                                           ("405B", 405_853_388_800)])
def test_published_parameter_counts_on_meta(flavor, count):
    with torch.device("meta"):
        model = Transformer(llama3_flavors[flavor])
    assert num_params(model) == count


def test_llama32_ties_embeddings_and_scales_rope_by_32_llama31_unties_and_scales_by_8():
    small = [llama3_flavors[f] for f in ("3.2-1B", "3.2-3B")]
    assert all(a.tie_embeddings and a.rope_factor == 32.0 and a.n_kv_heads == 8 for a in small)
    assert all(not a.tie_embeddings and a.rope_factor == 8.0 for a in (llama3_flavors[f] for f in ("8B", "70B")))


def test_31_and_33_names_are_the_torchtitan_flavors():
    assert llama3_flavors["3.1-8B"] is llama3_flavors["8B"]
    assert llama3_flavors["3.1-70B"] is llama3_flavors["3.3-70B"] is llama3_flavors["70B"]
    assert llama3_flavors["3.1-405B"] is llama3_flavors["405B"]
