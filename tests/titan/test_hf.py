"""titan.hf against transformers' own LlamaForCausalLM and Qwen3ForCausalLM: random tiny configs import (`load`)
and export (`save`) with the same fp64 logits (1e-6 of the largest logit), a single file or a sharded index; an
export loads in transformers with no warning (no missing or unexpected keys); a model_type titan lacks is one line
naming those it has."""

import json
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import titan.hf  # noqa: E402
from titan.hf import load_hf_weights, read_hf_config  # noqa: E402
from titan.models.llama3.hf_config import args_from_hf  # noqa: E402
from titan.tools.cli import UserError  # noqa: E402

TOL = 1e-6
T = 64
VOCAB = 101


def llama3_rope(factor, original, low=1.0, high=4.0, theta=500000.0):
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


# Each covers one thing a real folder of the family varies. The Llamas use head_dim 16 so that RoPE's low
# frequencies have wavelengths beyond the original contexts below, and scaling changes the logits; the Qwen3s
# have a head_dim other than hidden_size / heads, as the released ones do.
CONFIGS = {
    "llama/gqa-no-scaling": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama/llama3-factor8-ctx2048": dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=128,
                                         rope_parameters=llama3_rope(8.0, 2048)),
    "llama/llama3-factor32-tied": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                                       tie_word_embeddings=True, rope_parameters=llama3_rope(32.0, 8192)),
    "llama/llama3-factor32-ctx512-odd-ffn": dict(num_attention_heads=4, num_key_value_heads=4,
                                                 intermediate_size=97, rms_norm_eps=1e-6,
                                                 rope_parameters=llama3_rope(32.0, 512, 2.0, 8.0)),
    "qwen3/gqa-untied-theta1e6": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      intermediate_size=96, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6}),
    "qwen3/mqa-tied-odd-ffn-theta1e4": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                            intermediate_size=97, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "qwen3/mha-headdim8-eps1e-5": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8,
                                       intermediate_size=130, rms_norm_eps=1e-5,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_model(name, seed=0):
    config_class, model_class = CLASSES[name.split("/")[0]]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB,
                                              max_position_embeddings=131072, **CONFIGS[name])
    model = getattr(transformers, model_class)(cfg).to(torch.float64).eval()
    with torch.no_grad():  # transformers initializes norms to one: randomize them so their weights are tested too
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def relative_diff(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def tokens(seed):
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_load_gives_transformers_logits(name, tmp_path):
    model = hf_model(name)
    model.save_pretrained(tmp_path)
    ours = titan.hf.load(tmp_path)
    assert next(ours.parameters()).dtype == torch.float64
    with torch.no_grad():
        want, got = model(tokens(1)).logits, ours(tokens(1))
    diff = relative_diff(got, want)
    print(f"import {name}: max |logit diff| / max |logit| = {diff:.1e}")
    assert got.shape == (2, T, VOCAB) and diff < TOL


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def load_quietly(folder, model_class):
    """transformers' from_pretrained, failing on any warning it logs or raises (missing or unexpected keys)."""
    handler = _Collect()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = getattr(transformers, model_class).from_pretrained(folder)
    finally:
        hf_logger.removeHandler(handler)
    assert not handler.records and not [str(w.message) for w in caught]
    return model.eval()


@pytest.mark.parametrize("name, shard_bytes", [(n, 0) for n in CONFIGS] + [("llama/llama3-factor32-tied", 40_000),
                                                                          ("qwen3/gqa-untied-theta1e6", 40_000)])
def test_save_loads_in_transformers_with_the_same_logits(name, shard_bytes, tmp_path):
    hf_model(name, seed=2).save_pretrained(tmp_path / "src")
    ours = titan.hf.load(tmp_path / "src")
    files = titan.hf.save(ours, tmp_path / "out", torch.float64, **({"max_shard_bytes": shard_bytes}
                                                                    if shard_bytes else {}))
    assert (len(files) > 1) == bool(shard_bytes)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file() == bool(shard_bytes)
    exported = load_quietly(tmp_path / "out", CLASSES[name.split("/")[0]][1])
    assert exported.dtype == torch.float64 and json.loads((tmp_path / "out" / "config.json").read_text())[
        "dtype"] == "float64"
    with torch.no_grad():
        diff = relative_diff(ours(tokens(3)), exported(tokens(3)).logits)
    print(f"export {name}: max |logit diff| / max |logit| = {diff:.1e}")
    assert diff < TOL
    # Sharded or not, the folder loads back to the same model.
    again = titan.hf.load(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def test_bfloat16_export_is_declared_and_loaded_as_bfloat16(tmp_path):
    hf_model("qwen3/gqa-untied-theta1e6").save_pretrained(tmp_path / "src")
    titan.hf.save(titan.hf.load(tmp_path / "src", torch.float32), tmp_path / "out", torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_quietly(tmp_path / "out", "Qwen3ForCausalLM").dtype == torch.bfloat16


def test_load_casts_to_the_dtype_asked_for(tmp_path):
    hf_model("llama/gqa-no-scaling").save_pretrained(tmp_path)
    assert {p.dtype for p in titan.hf.load(tmp_path, torch.bfloat16).parameters()} == {torch.bfloat16}


def test_a_model_type_titan_lacks_is_one_line_naming_those_it_has(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(UserError, match=r"model_type 'mamba' is not supported; titan reads llama, qwen3"):
        titan.hf.load(tmp_path)


def test_sliding_window_attention_is_refused(tmp_path):
    hf_model("qwen3/gqa-untied-theta1e6").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(UserError, match="use_sliding_window = True is not supported"):
        titan.hf.load(tmp_path)


def test_weights_that_disagree_with_the_config_are_named(tmp_path):
    hf_model("llama/gqa-no-scaling").save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path)
    args = args_from_hf({**cfg, "intermediate_size": 64})
    with pytest.raises(UserError, match="mlp.down_proj.weight has shape .* config.json and the weights disagree"):
        load_hf_weights(tmp_path, args)
