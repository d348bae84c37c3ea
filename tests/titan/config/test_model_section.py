"""The [model] section: 0 keeps the flavor's value, a negative override or a BPE vocabulary too small for the bytes
is refused naming the key, and the hf tokenizer needs its folder."""

import pytest

from titan.config import ConfigError, parse_args


@pytest.mark.parametrize("argv, message", [
    (["--model.n_layers", "-1"], "model.n_layers must be >= 0, got -1"),
    (["--model.rope_theta", "-5e5"], "model.rope_theta must be >= 0, got -500000.0"),
    (["--model.bpe_vocab_size", "299"], "model.bpe_vocab_size must be >= 300 (bytes + specials), got 299"),
    (["--model.bpe_vocab_size", "0"], "model.bpe_vocab_size must be > 0, got 0"),
    (["--model.tokenizer", "hf"], "model.tokenizer 'hf' needs model.hf_assets_path"),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_a_bad_model_value_is_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_overrides_default_to_keeping_the_flavor():
    model = parse_args([]).model
    assert (model.n_layers, model.dim, model.vocab_size, model.rope_theta) == (0, 0, 0, 0.0)
    assert (model.rope_scaling, model.tie_embeddings) == ("flavor", "flavor")
