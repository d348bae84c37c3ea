"""Qwen3-MoE sizes as published (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json); `debug` is a small
MoE for CPU runs and tests."""

from titan.models.qwen3_moe.model import Qwen3MoeModelArgs

qwen3_moe_flavors = {
    "debug": Qwen3MoeModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, hidden_dim=768,
                               moe_hidden_dim=128, num_experts=8, top_k=2, vocab_size=4096, max_seq_len=2048),
    "30B-A3B": Qwen3MoeModelArgs(),
    "235B-A22B": Qwen3MoeModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288,
                                   moe_hidden_dim=1536),
}
