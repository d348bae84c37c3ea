"""Llama 3.x sizes as published by Meta (3.2 1B/3B, 3.1 8B/70B/405B, 3.3 70B); `debug` is a ~10M-parameter model
for CPU runs and tests, `debugmodel` TorchTitan's debug model. TorchTitan's names (8B, 70B, 405B) are kept."""

from titan.models.llama3.model import ModelArgs

# Llama 3.2's small models: factor-32 RoPE scaling and tied embeddings.
_LLAMA32 = dict(rope_factor=32.0, tie_embeddings=True, n_kv_heads=8)

llama3_flavors = {
    "debug": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                       max_seq_len=2048),
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048),
    "3.2-1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, hidden_dim=8192, **_LLAMA32),
    "3.2-3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, hidden_dim=8192, **_LLAMA32),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096),
}
llama3_flavors["3.1-8B"] = llama3_flavors["8B"]
llama3_flavors["3.1-70B"] = llama3_flavors["70B"]
llama3_flavors["3.1-405B"] = llama3_flavors["405B"]
# Llama 3.3 70B has 3.1 70B's architecture (new weights).
llama3_flavors["3.3-70B"] = llama3_flavors["70B"]
