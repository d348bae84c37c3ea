"""Against transformers' own Llama: random tiny configs import and export with the same fp64 logits (1e-6)."""

import json
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titan.models.llama3 import Transformer  # noqa: E402
from titan.models.llama3.hf_config import args_from_hf, read_hf_config  # noqa: E402
from titan.models.llama3.hf_files import load_hf_weights, save_hf  # noqa: E402

TOL = 1e-6
T = 64


def llama3_rope(factor, original, low=1.0, high=4.0, theta=500000.0):
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


# Each covers one thing a real Llama 3.x folder varies; all use head_dim 16 so that RoPE's low frequencies have
# wavelengths beyond the original contexts below, and scaling changes the logits.
CONFIGS = {
    "gqa-no-scaling": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-factor8-ctx2048": dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=128,
                                   rope_parameters=llama3_rope(8.0, 2048)),
    "llama3-factor32-tied": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
                                 tie_word_embeddings=True, rope_parameters=llama3_rope(32.0, 8192)),
    "llama3-factor32-ctx512-odd-ffn": dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=97,
                                           rms_norm_eps=1e-6, rope_parameters=llama3_rope(32.0, 512, 2.0, 8.0)),
}


def hf_model(name, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=101,
                                   max_position_embeddings=131072, **CONFIGS[name])
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():  # transformers initializes norms to one: randomize them so their weights are tested too
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def titan_logits(args, state, tokens):
    model = Transformer(args)
    model.load_state_dict(state)
    model.to(torch.float64).init_buffers()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("name", CONFIGS)
def test_import_gives_transformers_logits(name, tmp_path):
    model = hf_model(name)
    model.save_pretrained(tmp_path)
    args = args_from_hf(read_hf_config(tmp_path))
    args = type(args)(**{**vars(args), "max_seq_len": T})
    tokens = torch.randint(0, 101, (2, T), generator=torch.Generator().manual_seed(1))
    want = hf_logits(model, tokens)
    got = titan_logits(args, load_hf_weights(tmp_path, args), tokens)
    diff = (got - want).abs().max().item()
    print(f"import {name}: max |logit diff| {diff:.2e} (logits up to {want.abs().max():.2f})")
    assert diff < TOL


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def load_quietly(folder):
    """transformers' LlamaForCausalLM.from_pretrained, failing on any warning it logs or raises."""
    handler = _Collect()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.LlamaForCausalLM.from_pretrained(folder)
    finally:
        hf_logger.removeHandler(handler)
    assert not handler.records and not [str(w.message) for w in caught]
    return model.eval()


@pytest.mark.parametrize("name, shard_bytes", [(n, 0) for n in CONFIGS] + [("llama3-factor32-tied", 40_000)])
def test_export_loads_in_transformers_with_the_same_logits(name, shard_bytes, tmp_path):
    source = hf_model(name, seed=2)
    source.save_pretrained(tmp_path / "src")
    args = args_from_hf(read_hf_config(tmp_path / "src"))
    args = type(args)(**{**vars(args), "max_seq_len": T})
    state = load_hf_weights(tmp_path / "src", args)
    files = save_hf(tmp_path / "out", state, args, torch.float64, **({"max_shard_bytes": shard_bytes}
                                                                    if shard_bytes else {}))
    assert (len(files) > 1) == bool(shard_bytes)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file() == bool(shard_bytes)
    exported = load_quietly(tmp_path / "out")
    assert exported.dtype == torch.float64 and json.loads((tmp_path / "out" / "config.json").read_text())[
        "dtype"] == "float64"
    tokens = torch.randint(0, 101, (2, T), generator=torch.Generator().manual_seed(3))
    diff = (hf_logits(exported, tokens) - titan_logits(args, state, tokens)).abs().max().item()
    print(f"export {name}: max |logit diff| {diff:.2e}")
    assert diff < TOL


def test_bfloat16_export_is_declared_and_loaded_as_bfloat16(tmp_path):
    source = hf_model("llama3-factor8-ctx2048")
    source.save_pretrained(tmp_path / "src")
    args = args_from_hf(read_hf_config(tmp_path / "src"))
    save_hf(tmp_path / "out", load_hf_weights(tmp_path / "src", args), args, torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_quietly(tmp_path / "out").dtype == torch.bfloat16
