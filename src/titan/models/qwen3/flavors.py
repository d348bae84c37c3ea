"""Qwen3 dense sizes as published (Qwen/Qwen3-*/config.json); `debug` is a small model for CPU runs and tests."""

from titan.models.qwen3.model import Qwen3ModelArgs

qwen3_flavors = {
    "debug": Qwen3ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768,
                            vocab_size=4096, max_seq_len=2048),
    "0.6B": Qwen3ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_embeddings=True),
    "1.7B": Qwen3ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_embeddings=True),
    "4B": Qwen3ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_embeddings=True),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
}
