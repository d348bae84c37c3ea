"""Llama 3.1 sizes as published by Meta; `debug` is a ~10M-parameter model for CPU runs and tests."""

from titan.models.llama3.model import ModelArgs

llama3_flavors = {
    "debug": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=4096, multiple_of=64,
                       max_seq_len=2048),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096),
}
