"""The run's Llama args: model.* keys override the flavor (0 / "flavor" keep it), the vocabulary is model.vocab_size
else the tokenizer's, the RoPE table is the training sequence length, and a tokenizer bigger than the model's
vocabulary or an hf flavor without a folder is refused naming the fix."""

from types import SimpleNamespace

import pytest

from titan.config import parse_args
from titan.models.common.resolve import args_from_folder, hf_weights_folder, model_overrides, update_model_args
from titan.models.llama3 import llama3_flavors
from titan.tools.cli import UserError

TOKENIZER = SimpleNamespace(vocab_size=300)


def test_only_the_keys_that_are_set_override_the_flavor():
    argv = ["--model.rope_theta", "1e6", "--model.tie_embeddings", "untied", "--model.hidden_dim", "96"]
    model = parse_args(argv).model
    assert model_overrides(model) == {"rope_theta": 1e6, "tie_embeddings": False, "hidden_dim": 96}
    assert model_overrides(parse_args([]).model) == {}


def test_vocabulary_from_the_tokenizer_and_rope_table_of_the_sequence_length():
    args = update_model_args(llama3_flavors["debug"], parse_args(["--training.seq_len", "48"]), TOKENIZER)
    assert (args.vocab_size, args.max_seq_len, args.dim) == (300, 48, llama3_flavors["debug"].dim)
    padded = update_model_args(llama3_flavors["debug"], parse_args(["--model.vocab_size", "512"]), TOKENIZER)
    assert padded.vocab_size == 512


def test_a_tokenizer_bigger_than_the_vocabulary_is_refused():
    with pytest.raises(UserError, match="the tokenizer has 300 tokens but the model's vocabulary only 256; raise "
                                        "model.vocab_size"):
        update_model_args(llama3_flavors["debug"], parse_args(["--model.vocab_size", "256"]), TOKENIZER)


def test_the_hf_flavor_needs_a_folder_and_only_an_hf_initial_load_is_one(tmp_path):
    with pytest.raises(UserError, match="model.flavor 'hf' takes the architecture from a Hugging Face folder: set "
                                        "checkpoint.initial_load_path"):
        args_from_folder("llama", parse_args(["--model.flavor", "hf"]))
    dcp_load = parse_args(["--checkpoint.initial_load_path", str(tmp_path)])
    assert hf_weights_folder(dcp_load) is None
    dcp_load.checkpoint.initial_load_in_hf = True
    assert hf_weights_folder(dcp_load) == tmp_path
