"""Hugging Face layout: exact round trips, and the permuted weights compute the same attention scores."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.titan.conftest import TINY, run_train
from titan.components.checkpoint.safe_reader import SafeFileSystemReader, load_metadata
from titan.models.common.hf_adapter import from_hf, to_hf
from titan.models.common.rope import apply_rotary, rope_cache
from titan.models.llama3 import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16, max_seq_len=32)


def tiny_state():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.state_dict()


def test_round_trip_is_exact():
    sd = tiny_state()
    back = from_hf(to_hf(sd, ARGS), ARGS)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_hf_names():
    hf = to_hf(tiny_state(), ARGS)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "lm_head.weight" in hf
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)


def rotate_half_rope(x_BTHD, table):
    """HF's rotary: rotate the two halves of each head with the same frequencies."""
    cos = torch.cat([table[: x_BTHD.shape[1], :, 0]] * 2, dim=-1)[None, :, None, :]
    sin = torch.cat([table[: x_BTHD.shape[1], :, 1]] * 2, dim=-1)[None, :, None, :]
    x1, x2 = x_BTHD.chunk(2, dim=-1)
    return x_BTHD * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_permuted_q_k_give_the_same_scores_under_hf_rotary():
    sd, hf = tiny_state(), None
    hf = to_hf(sd, ARGS)
    x = torch.randn(1, 8, 64)
    table = rope_cache(ARGS, 8)

    def scores(wq, wk, rotary):
        q = rotary((x @ wq.T).view(1, 8, 4, 16), table)
        k = rotary((x @ wk.T).view(1, 8, 2, 16), table).repeat_interleave(2, dim=2)
        return torch.einsum("bthd,bshd->bhts", q, k)

    meta = scores(sd["layers.0.attention.wq.weight"], sd["layers.0.attention.wk.weight"], apply_rotary)
    hf_scores = scores(hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"],
                       rotate_half_rope)
    torch.testing.assert_close(hf_scores, meta, atol=1e-5, rtol=1e-5)


def test_unknown_hf_key():
    with pytest.raises(ValueError, match="unknown Hugging Face parameter"):
        from_hf({"model.layers.0.self_attn.rotary.weight": torch.zeros(1)}, ARGS)


def checkpoint_model(step_dir):
    metadata = load_metadata(step_dir)
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.")}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(step_dir)))
    return state


def test_checkpoint_to_hf_and_back_is_exact(tmp_path):
    run = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
    run_train([*run, "--job.dump_folder", str(tmp_path / "a")])
    proc = run_train(["--to-hf", str(tmp_path / "hf"), *run, "--job.dump_folder", str(tmp_path / "a")],
                     module="titan.export")
    assert proc.stdout.splitlines()[-1].startswith("done: export to Hugging Face in ")
    assert proc.stdout.splitlines()[-1].endswith(f", outputs in {tmp_path / 'hf'} (config.json, safetensors)")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["model_type"] == "llama"
    assert len(load_file(str(tmp_path / "hf" / "model.safetensors"))) == 2 * 9 + 3
    run_train(["--from-hf", str(tmp_path / "hf"), *run, "--job.dump_folder", str(tmp_path / "b")],
              module="titan.export")
    trained = checkpoint_model(tmp_path / "a" / "checkpoint" / "step-2")
    imported = checkpoint_model(tmp_path / "b" / "checkpoint" / "step-0")
    assert trained.keys() == imported.keys()
    for k in trained:
        assert torch.equal(trained[k], imported[k]), k
    proc = run_train([*run, "--job.dump_folder", str(tmp_path / "b")])
    assert f"resumed from checkpoint {tmp_path / 'b' / 'checkpoint' / 'step-0'} (model)" in proc.stdout
