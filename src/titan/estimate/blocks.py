"""What the step-time model reads of one block's shapes: the weights of a GQA block, the attention head dims, and the
elements a block saves for backward per token, for GQA or latent (MLA) attention and a dense SwiGLU or a mixture of
experts."""

from __future__ import annotations


def layer_params(args) -> dict[str, int]:
    """The weights of one GQA block with a dense SwiGLU (Llama, Qwen3), by name."""
    kv_dim = (args.n_kv_heads or args.n_heads) * args.head_dim
    q_dim = args.n_heads * args.head_dim
    return {"wq": args.dim * q_dim, "wk": args.dim * kv_dim, "wv": args.dim * kv_dim, "wo": q_dim * args.dim,
            "w1": args.dim * args.ffn_hidden_dim, "w2": args.ffn_hidden_dim * args.dim,
            "w3": args.dim * args.ffn_hidden_dim,
            "norms": 2 * args.dim + (2 * args.head_dim if getattr(args, "qk_norm", False) else 0)}


def latent_attention(args) -> bool:
    """DeepSeek-V3's multi-head latent attention (keys and values from a low-rank latent)."""
    return hasattr(args, "kv_lora_rank")


def estimable(args) -> bool:
    """Whether the step-time model knows `args`' blocks: GQA (Llama, Qwen3) or latent attention (DeepSeek-V3),
    with a dense SwiGLU or a mixture of experts; other models (e.g. Hyena) are not estimated."""
    if not all(hasattr(args, k) for k in ("dim", "n_layers", "n_heads", "vocab_size")):
        return False
    return hasattr(args, "inter_dim") if latent_attention(args) else all(
        hasattr(args, k) for k in ("head_dim", "ffn_hidden_dim"))


def attention_dims(args) -> tuple[int, int, int]:
    """(heads, query/key head dim, value head dim)."""
    if latent_attention(args):
        return args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    return args.n_heads, args.head_dim, args.head_dim


def dense_hidden(args) -> int:
    """The dense SwiGLU's hidden size (DeepSeek-V3 calls it inter_dim)."""
    return args.inter_dim if latent_attention(args) else args.ffn_hidden_dim


def _attention_elems(args, tp: int) -> float:
    if latent_attention(args):
        H, qk, v = attention_dims(args)
        H, rope = H / tp, args.qk_rope_head_dim
        # The query and key-value latents before and after their norms, the shared rotary key (whole on every TP
        # rank); the rank's heads: the projected queries and up-projected keys/values; the fp32 rotary copies;
        # SDPA's concatenated q and k; its output and wo's input.
        latents = 2 * args.q_lora_rank + 2 * args.kv_lora_rank + rope
        return latents + H * qk + H * (args.qk_nope_head_dim + v) + 2 * (H + 1) * rope + 2 * H * qk + 2 * H * v
    hd = args.head_dim
    H, Hkv = args.n_heads / tp, (args.n_kv_heads or args.n_heads) / tp
    attention = (H + 2 * Hkv) * hd + 2 * (H + Hkv) * hd + 3 * H * hd + 2 * H * hd
    if getattr(args, "qk_norm", False):  # the per-head norms keep their inputs
        attention += (H + Hkv) * hd
    return attention


def routed_active_params(args) -> int:
    """Weights of the routed experts one token computes with in a MoE block: k experts' three matrices."""
    m = args.moe_args
    return 3 * args.dim * m.hidden_dim * m.top_k


def moe_activation_elems(moe_args, dim: int, load: float = 1.0) -> float:
    """Per token, what MoE.forward saves for backward (bf16 elements, fp32 counting two, int64 four): the router's
    fp32 input and scores and the chosen experts (with group-limited sigmoid routing its group choices, with
    renormalisation the weights and their sum); for each of the k routed copies two int64 indices (to expert order
    and back), the gathered input, both up-projections, the SiLU and the product, the experts' output and its bf16
    routing weight (the weighted sum's operands); the shared experts' SwiGLU. `load`: the copies the rank's
    experts compute over k per token (expert parallel), which scales what the grouped GEMMs save (their input and
    outputs); the rest stays with the tokens' rank."""
    k, h, experts, groups = moe_args.top_k, moe_args.hidden_dim, moe_args.num_experts, moe_args.n_groups
    router = 2 * dim + 2 * experts + 4 * k
    if moe_args.score_func == "sigmoid" and groups > 1:
        router += 8 * groups + 4 * moe_args.topk_groups + groups / 2
    if moe_args.route_norm:
        router += 2 + 2 * k
    return router + k * (4 + 4 + dim + 1) + load * k * (dim + 4 * h) + 4 * h * moe_args.num_shared_experts


def _matmul_outputs(args, tp: int, moe: bool) -> float:
    """Elements per token of a block's plain matmul outputs (aten.mm: the projections, a dense SwiGLU, the router
    in fp32 and the shared experts; not the routed experts' grouped GEMMs)."""
    D, (H, qk, v) = args.dim, attention_dims(args)
    if latent_attention(args):
        # The low-rank projections are whole on every TP rank, the up-projections its heads.
        q = (args.q_lora_rank if args.q_lora_rank else 0) + H * qk / tp
        attention = q + args.kv_lora_rank + args.qk_rope_head_dim + H * (args.qk_nope_head_dim + v) / tp + D
    else:
        attention = (H + 2 * (args.n_kv_heads or args.n_heads)) * qk / tp + D
    if not moe:
        return attention + 2 * dense_hidden(args) / tp + D
    # A MoE layer computes the rank's sequence shard (tokens / tp) with whole weights.
    moe_args = args.moe_args
    shared = 2 * moe_args.hidden_dim * moe_args.num_shared_experts + D if moe_args.num_shared_experts else 0
    return attention + (2 * moe_args.num_experts + shared) / tp


def block_activation_elems(args, tp: int, kind: str, moe: bool = False, load: float = 1.0) -> float:
    """Elements saved for backward per local token by one block; "none", "full" or "op" checkpointing; `moe`: the
    block's feed-forward is args.moe_args' mixture of experts (`load`: see moe_activation_elems).

    SP-sharded tensors count 1/tp, the all-gathered norm outputs and the row-parallel partial sums full width, a
    MoE layer's input and what it saves 1/tp (it routes the rank's sequence shard); fp32 copies count twice.
    """
    D = args.dim
    if kind == "full":
        return D / tp
    H, _, v = attention_dims(args)
    if kind == "op":
        if not moe and not latent_attention(args):
            Hkv, hd, F = (args.n_kv_heads or args.n_heads) / tp, args.head_dim, args.ffn_hidden_dim
            # The policy saves odd-numbered matmuls (wq, wv, w1, w2) and the attention output.
            return D / tp + H / tp * hd + Hkv * hd + F / tp + D + H / tp * hd
        # Elsewhere: every second matmul output taken as half of them, and the attention output.
        return D / tp + _matmul_outputs(args, tp, moe) / 2 + H / tp * v
    if moe:
        return 2 * D / tp + D + (D + moe_activation_elems(args.moe_args, D, load)) / tp + _attention_elems(args, tp)
    return 2 * D / tp + 2 * D + _attention_elems(args, tp) + 4 * dense_hidden(args) / tp
