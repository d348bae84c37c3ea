"""DeepSeek-V3 sizes: `671B` as published (transformers' DeepseekV3Config defaults, multi-token prediction not
built), `16B` TorchTitan's 16B (DeepSeek-V2-Lite's widths) with DeepSeek-V3's sigmoid routing, and `debug`, a
~10M-parameter MoE for CPU runs and tests."""

from titan.models.deepseek_v3.model import ModelArgs

deepseek_v3_flavors = {
    "debug": ModelArgs(dim=256, n_layers=4, n_dense_layers=1, n_heads=8, vocab_size=4096, inter_dim=512,
                       moe_inter_dim=128, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                       kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_factor=1.0,
                       rope_mscale=0.0, rope_mscale_all_dim=0.0, max_context_len=2048, max_seq_len=2048),
    "16B": ModelArgs(dim=2048, n_layers=27, n_dense_layers=1, n_heads=16, vocab_size=102400, inter_dim=10944,
                     moe_inter_dim=1408, n_routed_experts=64, n_shared_experts=2, n_activated_experts=6,
                     q_lora_rank=0, rope_mscale=0.0, rope_mscale_all_dim=0.707),
    "671B": ModelArgs(dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, vocab_size=129280, inter_dim=18432,
                      moe_inter_dim=2048, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8,
                      n_expert_groups=8, n_limited_groups=4, route_scale=2.5, q_lora_rank=1536),
}
