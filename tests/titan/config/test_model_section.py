"""The [model] section: shared keys (name, flavor, tokenizer ...) are the section's own; every other key is an
architecture field of the named family's args dataclass, converted to that field's type and refused in one line
when the family has no such field; the keys survive a round trip through the written config."""

from dataclasses import dataclass

import pytest

from titan.config import ConfigError, parse_args, to_toml
from titan.models import register_model_spec
from titan.protocols.model_spec import ModelSpec


@dataclass
class ConvArgs:
    width: int = 8
    kernel: tuple[int, int] = (3, 3)


register_model_spec(ModelSpec("conv-for-config-tests", {"tiny": ConvArgs()}, build_model=None, parallelize=None,
                              build_dataloader=None))
CONV = ["--model.name", "conv-for-config-tests"]


@pytest.mark.parametrize("argv, message", [
    (["--model.bpe_vocab_size", "299"], "model.bpe_vocab_size must be >= 300 (bytes + specials), got 299"),
    (["--model.bpe_vocab_size", "0"], "model.bpe_vocab_size must be > 0, got 0"),
    (["--model.tokenizer", "hf"], "model.tokenizer 'hf' needs model.hf_assets_path"),
    (["--model.n_layers", "two"], "model.n_layers must be an integer, got 'two'"),
    (["--model.tie_embeddings", "untied"], "model.tie_embeddings must be true or false, got 'untied'"),
    (["--model.rope_scaling", "yarn"], "model.rope_scaling must be one of 'none', 'llama3', got 'yarn'"),
    (["--model.name", "qwen3_moe", "--model.mlp_only_layers", "0,x"],
     "model.mlp_only_layers must be a list, each an integer, got '0,x'"),
    (["--model.head_dim", "64"], "unknown key model.head_dim: model llama3 has no such field; its architecture "
                                 "fields: dim, n_layers"),
    ([*CONV, "--model.rope_theta", "1e4"], "unknown key model.rope_theta: model conv-for-config-tests has no such "
                                           "field; its architecture fields: width, kernel"),
    ([*CONV, "--model.kernel", "5"], "model.kernel of conv-for-config-tests cannot be set from a config"),
    (["--model.args", "x"], "unknown key model.args"),
], ids=lambda v: " ".join(v[-2:]) if isinstance(v, list) else "")
def test_a_bad_model_key_is_one_line_naming_it(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_family_keys_take_the_fields_types():
    assert parse_args(["--model.n_layers", "2", "--model.tie_embeddings", "false", "--model.rope_theta", "1e4",
                       "--model.n_kv_heads", "2"]).model.args == {
        "n_layers": 2, "tie_embeddings": False, "rope_theta": 1e4, "n_kv_heads": 2}
    assert parse_args(["--model.name", "qwen3", "--model.head_dim", "64"]).model.args == {"head_dim": 64}
    assert parse_args(["--model.name", "qwen3_moe", "--model.mlp_only_layers", "0,3"]).model.args == {
        "mlp_only_layers": [0, 3]}
    assert parse_args([*CONV, "--model.width", "4"]).model.args == {"width": 4}
    assert parse_args([]).model.args == {}


def test_family_keys_in_a_file_and_a_round_trip_through_the_written_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "qwen3"\nflavor = "debug"\nn_layers = 2\nrope_theta = 10000\n'
                    'tie_embeddings = true\n')
    config = parse_args(["--config", str(path), "--model.dim", "128"])
    assert config.model.args == {"n_layers": 2, "rope_theta": 10000.0, "tie_embeddings": True, "dim": 128}
    (tmp_path / "again.toml").write_text(to_toml(config))
    assert parse_args(["--config", str(tmp_path / "again.toml")]) == config
    path.write_text('[model]\nn_layers = 2.5\n')
    with pytest.raises(ConfigError, match=r"model.n_layers must be an integer, got 2.5"):
        parse_args(["--config", str(path)])
