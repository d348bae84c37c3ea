"""MLA and YaRN against transformers' DeepseekV3Attention and rotary embedding (random small configs, float64)."""

import pytest
import torch

from titan.models.common.mla import MLA, MLAArgs
from titan.models.common.rope import YaRN, yarn_frequencies, yarn_rope_cache
from titan.tools.cli import UserError

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

DIM, T = 48, 12
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}
YARN_NO_MSCALE = {k: v for k, v in YARN.items() if k != "mscale"}  # mscale_all_dim alone: another rule
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _config(q_lora_rank, rope, v_head_dim=12):
    return transformers.DeepseekV3Config(hidden_size=DIM, num_attention_heads=4, num_key_value_heads=4,
                                         q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=8,
                                         qk_rope_head_dim=16, v_head_dim=v_head_dim, max_position_embeddings=640,
                                         rope_parameters=dict(rope), attn_implementation="eager")


def _yarn(rope) -> YaRN:
    if rope["rope_type"] == "default":
        return YaRN(theta=rope["rope_theta"])
    return YaRN(theta=rope["rope_theta"], factor=rope["factor"],
                original_max_seq_len=rope["original_max_position_embeddings"], beta_fast=rope["beta_fast"],
                beta_slow=rope["beta_slow"], mscale=rope.get("mscale", 0.0), mscale_all_dim=rope["mscale_all_dim"])


@pytest.mark.parametrize("rope", [YARN, YARN_NO_MSCALE, ROPE], ids=["yarn", "yarn-no-mscale", "rope"])
def test_yarn_table_is_transformers_rotary_embedding(rope):
    cfg = _config(None, rope)
    theirs = DeepseekV3RotaryEmbedding(cfg)
    freqs, scale = yarn_frequencies(16, _yarn(rope))
    assert torch.equal(freqs, theirs.inv_freq)
    assert scale == pytest.approx(theirs.attention_scaling, rel=1e-15)
    if rope is YARN:  # the blend is not trivial here: some pairs kept, some divided, some between
        ratio = freqs / yarn_frequencies(16, YaRN())[0]
        assert ratio.max() == 1 and ratio.min() == pytest.approx(1 / 40) and ((ratio < 1) & (ratio > 1 / 40)).any()
    cos, sin = theirs(torch.zeros(1, dtype=torch.float64), torch.arange(T)[None])
    table = yarn_rope_cache(16, _yarn(rope), T)
    torch.testing.assert_close(table[..., 0], cos[0, :, :8].float(), rtol=0, atol=0)
    torch.testing.assert_close(table[..., 1], sin[0, :, :8].float(), rtol=0, atol=0)


# Values narrower or wider than the query/key heads (24): the kernel sees one size, padded with zeros.
@pytest.mark.parametrize("v_head_dim", [12, 40], ids=["v-narrower", "v-wider"])
@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q-full", "q-lora"])
@pytest.mark.parametrize("rope", [YARN, YARN_NO_MSCALE, ROPE], ids=["yarn", "yarn-no-mscale", "rope"])
def test_mla_matches_transformers_deepseek_v3_attention(q_lora_rank, rope, v_head_dim):
    cfg = _config(q_lora_rank, rope, v_head_dim)
    theirs = DeepseekV3Attention(cfg, layer_idx=0).to(torch.float64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.2)
    ours = MLA(DIM, MLAArgs(n_heads=4, q_lora_rank=q_lora_rank or 0, kv_lora_rank=24, qk_nope_head_dim=8,
                            qk_rope_head_dim=16, v_head_dim=v_head_dim), _yarn(rope)).to(torch.float64)
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
             "wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"}
    state = {k: theirs.state_dict()[names[k.split(".")[0]] + ".weight"] for k in ours.state_dict()}
    ours.load_state_dict(state)
    x = torch.randn(2, T, DIM, generator=generator, dtype=torch.float64)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want, _ = theirs(x, (cos, sin), mask)
    got = ours(x, yarn_rope_cache(16, _yarn(rope), T))
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-6, err


@pytest.mark.parametrize("kwargs", [dict(kv_lora_rank=0), dict(qk_rope_head_dim=7), dict(q_lora_rank=-1)])
def test_impossible_mla_args_are_user_errors(kwargs):
    with pytest.raises(UserError):
        MLAArgs(**kwargs)


def test_impossible_yarn_is_a_user_error():
    with pytest.raises(UserError):
        YaRN(factor=0.5)
