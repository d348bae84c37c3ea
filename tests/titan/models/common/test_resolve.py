"""A decoder family's run args: the flavor, then the config's --model.<field> keys, then the vocabulary
(model.vocab_size, else the tokenizer's) and a RoPE table of the training sequence length; a tokenizer bigger than
the model's vocabulary, a value the family refuses, or an hf flavor without a folder is one line naming the fix."""

from types import SimpleNamespace

import pytest

from titan.builders import resolve_model_args
from titan.config import parse_args
from titan.models import get_model_spec
from titan.models.common.resolve import args_from_folder, hf_weights_folder
from titan.models.llama3 import llama3_flavors
from titan.tools.cli import UserError

TOKENIZER = SimpleNamespace(vocab_size=300)


def resolve(*argv, model="llama3"):
    return resolve_model_args(get_model_spec(model), parse_args(["--model.name", model, *argv]), None, TOKENIZER)


def test_only_the_keys_that_are_set_override_the_flavor():
    args = resolve("--model.rope_theta", "1e6", "--model.tie_embeddings", "false", "--model.hidden_dim", "96")
    flavor = llama3_flavors["debug"]
    assert (args.rope_theta, args.tie_embeddings, args.hidden_dim) == (1e6, False, 96)
    assert (args.dim, args.n_layers, args.norm_eps, args.rope_scaling) == (flavor.dim, flavor.n_layers,
                                                                          flavor.norm_eps, flavor.rope_scaling)
    assert resolve("--model.head_dim", "16", model="qwen3").head_dim == 16


def test_vocabulary_from_the_tokenizer_and_rope_table_of_the_sequence_length():
    args = resolve("--training.seq_len", "48")
    assert (args.vocab_size, args.max_seq_len, args.dim) == (300, 48, llama3_flavors["debug"].dim)
    assert resolve("--model.vocab_size", "512").vocab_size == 512


def test_a_tokenizer_bigger_than_the_vocabulary_is_refused():
    with pytest.raises(UserError, match="the tokenizer has 300 tokens but the model's vocabulary only 256; raise "
                                        "model.vocab_size"):
        resolve("--model.vocab_size", "256")


def test_a_value_the_family_refuses_is_one_line():
    with pytest.raises(UserError, match="model: n_heads 16 is not divisible by n_kv_heads 3"):
        resolve("--model.n_kv_heads", "3")
    with pytest.raises(UserError, match="model: head dim 7 must be even"):
        resolve("--model.head_dim", "7", model="qwen3")
    with pytest.raises(UserError, match="^model: n_layers must be > 0, got 0$"):  # "model:" once
        resolve("--model.n_layers", "0")
    with pytest.raises(UserError, match="^model: decoder_sparse_step must be >= 1"):
        resolve("--model.decoder_sparse_step", "0", model="qwen3_moe")


def test_the_hf_flavor_needs_a_folder_and_only_an_hf_initial_load_is_one(tmp_path):
    with pytest.raises(UserError, match="model.flavor 'hf' takes the architecture from a Hugging Face folder: set "
                                        "checkpoint.initial_load_path"):
        args_from_folder("llama", parse_args(["--model.flavor", "hf"]))
    dcp_load = parse_args(["--checkpoint.initial_load_path", str(tmp_path)])
    assert hf_weights_folder(dcp_load) is None
    dcp_load.checkpoint.initial_load_in_hf = True
    assert hf_weights_folder(dcp_load) == tmp_path
